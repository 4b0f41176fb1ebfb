"""``verispec generate`` (one prompt) and ``verispec chat`` (interactive)."""
from __future__ import annotations

import argparse
import json
import sys

from ..models.device import add_device_argument, add_weights_argument


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="known name, .gguf file or HF folder (default: %(default)s)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (bfloat16 on CUDA; default: %(default)s)")
    add_weights_argument(p)
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'')
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--min-tokens", type=int, default=0, help="no EOS / stop token before this many tokens")
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--compile", action="store_true",
                   help="decode/verify forwards through torch.compile (fused small ops; the first steps pay "
                        "the compilation: on 2 cores 30-45 s a graph on a fresh machine, about 7 s once inductor's disk "
                        "caches hold it)")
    add_device_argument(p)


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate a completion for one prompt",
                       description="Generate text for one prompt, optionally with speculative decoding.")
    _common(g)
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, metrics)")
    g.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="with --json: each output token's target logprob and the K best alternatives")
    g.add_argument("--stream", action="store_true", help="print tokens as they are accepted")
    g.add_argument("--compare-vanilla", action="store_true",
                   help="also decode the prompt without speculation (same model and weights, once before and "
                        "once after the speculative run, after a short warm-up of both on another prompt) and "
                        "print its tokens/s, the speed-up and whether the outputs match")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat in the terminal",
                       description="Interactive chat; type /exit (or end input) to quit, /reset to clear history.")
    _common(c)
    c.add_argument("--system", default=None, help="system message")
    c.set_defaults(func=cmd_chat)


def _params(args):
    from ..core.sampling import SamplingParams
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
                          min_p=args.min_p, min_tokens=args.min_tokens, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                          logprobs=getattr(args, "logprobs", None))


def _llm(args):
    from .. import LLM
    return LLM(model=args.model, dtype=args.dtype, weights=args.weights, speculative_config=args.speculative_config,
               num_threads=args.threads, max_num_seqs=1, device=args.device, compile=args.compile)


def _errors(fn):
    def wrapped(args) -> int:
        from ..models.sources import ModelSourceError
        try:
            return fn(args)
        except (ValueError, ModelSourceError) as e:
            print(f"verispec {args.command}: error: {e}", file=sys.stderr)
            return 2
    return wrapped


@_errors
def cmd_generate(args) -> int:
    params = _params(args)
    llm = _llm(args)
    prompt = args.prompt
    if args.chat:
        prompt = {"prompt_token_ids": llm.tokenizer(llm.apply_chat_template(
            [{"role": "user", "content": prompt}]), add_special_tokens=False).input_ids}
    vanilla = _VanillaRuns(llm, prompt, params) if args.compare_vanilla else None
    printer = _StreamPrinter(llm) if args.stream and not args.json else None
    out = llm.generate([prompt], params, on_tokens=printer)[0]
    if args.json:
        lps = None if out.logprobs is None else [{"token_id": e.token_id, "logprob": e.logprob, "rank": e.rank,
                                                  "top": [list(t) for t in e.top]} for e in out.logprobs]
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "metrics": vars(out.metrics), "logprobs": lps,
                          "vanilla_metrics": vars(vanilla.metrics) if vanilla else None,
                          "draft_shape": llm.draft_shape.as_dict() if llm.draft_shape else None}))
        return 0
    print(out.text if printer is None else "")
    m = out.metrics
    spec = f", mean acceptance length {m.mean_acceptance_length:.2f}" if m.num_drafts else ""
    print(f"[{m.num_output_tokens} tokens in {m.time_s:.2f}s: {m.tokens_per_second:.1f} tokens/s{spec}]",
          file=sys.stderr)
    chosen = " (auto: the fastest faithful to the checkpoint)" if args.weights == "auto" else ""
    print(f"[weights: {llm.target.weights.value}{chosen}]", file=sys.stderr)
    if llm.draft_shape is not None:
        print(f"[draft shape chosen from this machine's measured costs: {llm.draft_shape.describe()}]",
              file=sys.stderr)
    if llm.compiled is not None:
        print(f"[{llm.compiled.describe()}]", file=sys.stderr)
    if m.modelled_speedup is not None:
        print(f"[the draft-budget estimator expected {m.modelled_speedup:.2f}x over plain decoding steps for "
              f"this answer; steps per draft budget: {m.draft_budgets}]", file=sys.stderr)
    if vanilla is not None:
        after = vanilla.after()
        v = after.tokens_per_second
        print(f"[vanilla (no speculation, same weights): {v:.1f} tokens/s (mean of a run before and one after); "
              f"speed-up {m.tokens_per_second / max(v, 1e-9):.2f}x; outputs identical: "
              f"{'yes' if after.token_ids == out.token_ids else 'no'}]", file=sys.stderr)
    return 0


class _VanillaRuns:
    """The same prompt decoded without speculation on the same loaded model, once before the
    speculative run and once after (``after``), so that a machine whose speed drifts during the
    demo moves both sides alike. Both engines first warm up on another prompt (first calls pay
    one-off allocation costs; a drafter that learns from earlier answers, such as the suffix
    tree, must not have seen this answer)."""

    WARM_PROMPT = "Name three colours."

    def __init__(self, llm, prompt, params):
        import dataclasses

        from .. import LLM
        self.plain = LLM(loaded=llm.target, max_num_seqs=1, compile=llm.compiled is not None)
        self.prompt, self.params = prompt, params
        warm = dataclasses.replace(params, max_tokens=min(8, params.max_tokens))
        for engine in (self.plain, llm):
            engine.generate([self.WARM_PROMPT], warm)
        self.before = self.plain.generate([prompt], params)[0]
        self.metrics = self.before.metrics

    def after(self):
        """The run after, and the mean rate of both (``tokens_per_second``), with their ids
        (None when the two vanilla runs differ)."""
        from types import SimpleNamespace
        again = self.plain.generate([self.prompt], self.params)[0]
        tokens = again.metrics.num_output_tokens + self.before.metrics.num_output_tokens
        seconds = again.metrics.time_s + self.before.metrics.time_s
        return SimpleNamespace(tokens_per_second=tokens / seconds if seconds > 0 else 0.0,
                               token_ids=again.token_ids if again.token_ids == self.before.token_ids else None)


class _StreamPrinter:
    """Prints each step's new text (the output layer's incremental detokenizer, without stop
    strings: the engine ends the output at one)."""

    def __init__(self, llm):
        from ..core.params import SamplingParams
        self.detok = llm.detokenizer(SamplingParams())

    def __call__(self, index: int, new_ids: list[int]) -> None:
        self.detok.push(new_ids)
        print(self.detok.delta(), end="", flush=True)


@_errors
def cmd_chat(args) -> int:
    params = _params(args)
    llm = _llm(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("verispec chat: /exit to quit, /reset to clear the conversation.", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        print("assistant> ", end="", flush=True)
        printer = _StreamPrinter(llm)
        out = llm.chat([history], params, on_tokens=printer)[0]
        print()
        history.append({"role": "assistant", "content": out.text})
