"""Speculative core benchmark: vanilla vs ``ngram`` vs ``draft_model``, greedy, batch 1.

Part A (SmolLM2-135M): 2 Spec-Bench prompts per category (26), vanilla / ngram / ngram_extra
(proposals cut to the match length + 1).
Part B (Qwen2.5-Coder 1.5B target, 0.5B draft): coding prompts (a subset: the 1.5B model runs
2-4 tokens/s on a 2-core CPU), vanilla / draft_model / draft_model with the shipped 64k reduced
draft vocabulary / ngram, acceptance per position.
Each part runs once per weight format (``--weights``): ``fp16`` (FBGEMM fp16-packed matmul
weights, the draft model too: a verification forward over a few tokens costs about a one-token
decode) and ``dense`` (plain fp32). Methods run interleaved per prompt in one process, on one
loaded target; speedup = method tokens/s / vanilla tokens/s of the same part.

    python benchmarks/spec_core.py [--part ab] [--weights fp16,dense] [--max-tokens 128] [--qwen-prompts 4]
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch loads: shared cores

import torch  # noqa: E402

from verispec import LLM, SamplingParams  # noqa: E402
from verispec.bench import harness  # noqa: E402
from verispec.data import per_category, spec_bench_questions  # noqa: E402
from verispec.models.loading import load_model  # noqa: E402


def chat_ids(tok, text: str) -> list[int]:
    return tok(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True), add_special_tokens=False).input_ids


def run(methods: dict[str, LLM], prompts: list[tuple[str, list[int]]], max_tokens: int) -> dict:
    """Interleave methods per prompt; aggregate per method and per (method, category)."""
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    rows = []
    for llm in methods.values():                      # warm-up
        llm.generate([{"prompt_token_ids": prompts[0][1]}], SamplingParams(temperature=0, max_tokens=4))
    for g in harness.generate_interleaved(methods, prompts, sp):
        out, m = g.output, g.output.metrics
        rows.append({"method": g.method, "category": g.category, "tokens": len(out.token_ids), "seconds": g.seconds,
                     "drafts": m.num_drafts, "accepted": m.num_accepted_tokens, "draft_tokens": m.num_draft_tokens,
                     "acceptance_rate_per_pos": m.acceptance_rate_per_pos, "same_as_vanilla": g.same_as_first})
        print(f"{g.category:16s} {g.method:12s} {len(out.token_ids) / g.seconds:6.2f} tok/s  "
              f"tau {m.mean_acceptance_length:.2f}", flush=True)
    return summarize(rows, list(methods))


def summarize(rows: list[dict], names: list[str]) -> dict:
    def agg(sel):
        tok, sec = sum(r["tokens"] for r in sel), sum(r["seconds"] for r in sel)
        drafts, acc = sum(r["drafts"] for r in sel), sum(r["accepted"] for r in sel)
        depth = max((len(r["acceptance_rate_per_pos"]) for r in sel), default=0)
        per_pos = [sum(r["acceptance_rate_per_pos"][i] * r["drafts"] for r in sel
                       if i < len(r["acceptance_rate_per_pos"])) / drafts if drafts else 0.0 for i in range(depth)]
        return {"tokens_per_s": tok / sec, "tau": 1 + acc / drafts if drafts else 1.0,
                "acceptance_rate_per_pos": per_pos, "identical_to_vanilla": all(r["same_as_vanilla"] for r in sel)}
    cats = sorted({r["category"] for r in rows})
    out = {"rows": rows, "overall": {}, "per_category": {}}
    for n in names:
        out["overall"][n] = agg([r for r in rows if r["method"] == n])
        out["per_category"][n] = {c: agg([r for r in rows if r["method"] == n and r["category"] == c]) for c in cats}
    base = out["overall"][names[0]]["tokens_per_s"]
    for n in names:
        out["overall"][n]["speedup"] = out["overall"][n]["tokens_per_s"] / base
        for c in cats:
            b = out["per_category"][names[0]][c]["tokens_per_s"]
            out["per_category"][n][c]["speedup"] = out["per_category"][n][c]["tokens_per_s"] / b
    return out


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
# ngram with proposals cut by match length (after an n-token match at most n + 1 tokens): tuned on
# other questions than these (spec_core.analysis.md)
NGRAM_EXTRA = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_extra": 1}
QWEN_DRAFT_VOCAB = "qwen2.5-coder-draft-vocab-64k/draft_vocab.safetensors"    # shipped, see checkpoints/


def part_a(max_tokens: int, weights: str) -> dict:
    target = load_model("smollm2-135m", weights=weights)
    qs = per_category(spec_bench_questions(), 2)
    prompts = [(q["category"], chat_ids(target.tokenizer, q["turns"][0])) for q in qs]
    methods = {"vanilla": LLM(loaded=target, max_num_seqs=1),
               "ngram": LLM(loaded=target, max_num_seqs=1, speculative_config=NGRAM),
               "ngram_extra": LLM(loaded=target, max_num_seqs=1, speculative_config=NGRAM_EXTRA)}
    return {"model": "smollm2-135m", "dtype": "float32", "weights": weights,
            "configs": {"ngram": NGRAM, "ngram_extra": NGRAM_EXTRA},
            **run(methods, prompts, max_tokens)}


def part_b(max_tokens: int, n_prompts: int, weights: str) -> dict:
    target = load_model("qwen2.5-coder-1.5b", weights=weights)
    draft = {"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4}
    draft_v64k = dict(draft, draft_vocab=QWEN_DRAFT_VOCAB)
    # chains of up to 6 that end after a draft token below probability 0.4 (the threshold HF's
    # assisted generation uses by default; not tuned on these prompts)
    draft_stop = dict(draft_v64k, num_speculative_tokens=6, draft_confidence_threshold=0.4)
    qs = [q for q in spec_bench_questions() if q["category"] == "coding"][:n_prompts]
    prompts = [(q["category"], chat_ids(target.tokenizer, q["turns"][0])) for q in qs]
    methods = {"vanilla": LLM(loaded=target, max_num_seqs=1),
               "draft_model": LLM(loaded=target, max_num_seqs=1, speculative_config=draft),
               "draft_model_v64k": LLM(loaded=target, max_num_seqs=1, speculative_config=draft_v64k),
               "draft_model_v64k_stop": LLM(loaded=target, max_num_seqs=1, speculative_config=draft_stop),
               "ngram": LLM(loaded=target, max_num_seqs=1, speculative_config=NGRAM)}
    return {"model": "qwen2.5-coder-1.5b", "draft": "qwen2.5-coder-0.5b", "dtype": "float32", "weights": weights,
            "configs": {"draft_model": draft, "draft_model_v64k": draft_v64k,
                        "draft_model_v64k_stop": draft_stop, "ngram": NGRAM},
            **run(methods, prompts, max_tokens)}


def render(res: dict) -> str:
    lines = ["Mean acceptance length tau includes the bonus token.", ""]
    for part in res["parts"]:
        cats = sorted(next(iter(part["per_category"].values())))
        lines += [f"## {part['model']}" + (f" (draft {part['draft']})" if "draft" in part else "")
                  + f", {part['weights']} weights", "", (f"Measured {part['measured_at']}. " if "measured_at" in part
                                                         else "") + "Configs: " + ", ".join(
                      f"{k} `{json.dumps(v)}`" for k, v in part["configs"].items()), "",
                  "| method | tok/s | speedup | tau | identical to vanilla | " + " | ".join(cats) + " |",
                  "|---|---|---|---|---|" + "---|" * len(cats)]
        for n, o in part["overall"].items():
            per = " | ".join(f"{part['per_category'][n][c]['speedup']:.2f}x" for c in cats)
            lines.append(f"| {n} | {o['tokens_per_s']:.2f} | {o['speedup']:.2f}x | {o['tau']:.2f} | "
                         f"{o['identical_to_vanilla']} | {per} |")
        lines += ["", "Acceptance rate per draft position:", ""]
        for n, o in part["overall"].items():
            if o["acceptance_rate_per_pos"]:
                lines.append(f"- {n}: " + ", ".join(f"{x:.2f}" for x in o["acceptance_rate_per_pos"]))
        lines.append("")
    return "\n".join(lines)


OUT = harness.Output("spec_core", "Speculative core benchmark (greedy, batch 1)", render, analysis=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="ab")
    ap.add_argument("--weights", default="fp16,dense", help="weight formats to run each part with")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--qwen-prompts", type=int, default=4)
    args = OUT.parse(ap)
    if args is None:
        return
    torch.set_num_threads(os.cpu_count() or 1)
    res = {"machine": harness.machine_record(), "max_tokens": args.max_tokens, "parts": []}
    if os.path.exists(args.out + ".json"):     # parts not rerun now are kept (same machine and settings)
        with open(args.out + ".json") as f:
            old = json.load(f)
        if old.get("max_tokens") == args.max_tokens:
            res["parts"] = old["parts"]
    for weights in args.weights.split(","):
        if "a" in args.part:
            merge_part(res, part_a(args.max_tokens, weights))
        if "b" in args.part:
            merge_part(res, part_b(args.max_tokens, args.qwen_prompts, weights))
        OUT.write(res, args.out)               # after every part: an interrupted run keeps what it did


def merge_part(res: dict, part: dict) -> None:
    """Replace the part of the same model and weights (a rerun), else append; keep a stable order."""
    part["measured_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    key = (part["model"], part["weights"])
    parts = [p for p in res["parts"] if (p["model"], p["weights"]) != key] + [part]
    res["parts"] = sorted(parts, key=lambda p: (p["weights"] != "fp16", p["model"] != "smollm2-135m"))


if __name__ == "__main__":
    main()
