"""``verispec audit``: check on your own model and prompts that speculation changes no output."""
from __future__ import annotations

import json
from pathlib import Path

DEFAULT_PROMPTS = ["Explain in two sentences why the sky is blue.", "Write a haiku about a lighthouse.",
                   "List three uses of a paperclip.", "What is 12 times 13? Answer briefly."]


def add_parser(sub) -> None:
    from .generate import _common
    a = sub.add_parser("audit", help="check losslessness of a speculative config on your model",
                       description="Greedy identity against vanilla decoding on your prompts (numerical ties "
                                   "reported), and a chi-square test of sampled speculative output against the "
                                   "target's exact distribution at your sampling settings. Exit 0 = pass, 1 = fail.")
    _common(a)
    a.add_argument("--prompts", help="a text file (one prompt per line) or JSONL with a 'prompt' field "
                                     "(default: four built-in prompts)")
    a.add_argument("--chat", action="store_true", help="apply the chat template to each prompt")
    a.add_argument("--samples", type=int, default=2000, help="sampled outputs for the chi-square test")
    a.add_argument("--depth", type=int, default=3, help="tokens per sampled output (the prefill's, then a step's)")
    a.add_argument("--sampled-prompts", type=int, default=1, help="prompts given a chi-square test")
    a.add_argument("--alpha", type=float, default=1e-3, help="fail below this p-value")
    a.add_argument("--tie-margin", type=float, default=1e-4, help="top-2 logit margin under which a greedy "
                                                                   "difference is a numerical tie")
    a.add_argument("--batch-size", type=int, default=64, help="sequences decoded together while sampling")
    a.add_argument("--report", help="write the report as JSON to this file")
    a.set_defaults(func=cmd_audit, temperature=1.0, max_tokens=64)


def _read_prompts(path: str | None) -> list[str]:
    if path is None:
        return list(DEFAULT_PROMPTS)
    text = Path(path).read_text(encoding="utf-8")
    if path.endswith(".jsonl"):
        out = [json.loads(line)["prompt"] for line in text.split("\n") if line.strip()]
    else:
        out = [line for line in text.splitlines() if line.strip()]
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def cmd_audit(args) -> int:
    from .. import LLM
    from ..audit import audit
    from .generate import _errors, _params

    @_errors
    def run(args) -> int:
        if not args.speculative_config:
            raise ValueError("--speculative-config is required: the audit compares it with vanilla decoding")
        params = _params(args)              # --temperature 0: the greedy check alone
        llm = LLM(model=args.model, dtype=args.dtype, weights=args.weights, speculative_config=args.speculative_config,
                  num_threads=args.threads, max_num_seqs=args.batch_size, device=args.device)
        texts = _read_prompts(args.prompts)
        if args.chat:
            texts = [llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
        ids = [llm.tokenizer(t, add_special_tokens=not args.chat).input_ids for t in texts]
        report = audit(llm, ids, params, max_tokens=args.max_tokens, samples=args.samples, depth=args.depth,
                       sampled_prompts=args.sampled_prompts, alpha=args.alpha, tie_margin=args.tie_margin)
        print(report.render())
        if args.report:
            Path(args.report).write_text(json.dumps(report.as_dict(), indent=1) + "\n")
        return 0 if report.passed else 1
    return run(args)
