"""How much of a prompt an EAGLE head needs to read: acceptance and first-step cost by
``head_context`` (the prompt's last pairs a head catches up on when a request starts).

A request's first draft step runs the head over its prompt's pairs (the catch-up): work that
vanilla decoding never does, paid once per request, and largest on the long prompts of
retrieval and summaries, whose short answers leave the least time to earn it back. This script
measures both sides of a window:

- acceptance: the shipped SmolLM2 EAGLE-3 head drafting a fixed chain of 3 every step (no
  estimator, so every window drafts the same steps), greedy, 128 new tokens, on Spec-Bench
  questions 3-6 of the long-prompt categories (rag, summarization, extraction, stem; the
  benchmark itself runs questions 1-2): tokens per step per window, outputs checked identical;
- cost: the first draft step (catch-up over the window, then the chain) after a prompt of 256,
  512 and 1024 tokens, fastest of ``--reps``, the head packed int4 as it runs beside the int4
  target.

    python benchmarks/head_context.py [--model smollm2-135m] [--reps 5] [--per-category 4] [--windows 0,128]

Writes benchmarks/results/head_context_<model>.{json,md}. The model's shipped EAGLE-3 head, the
int4 target (``weights="auto"`` of its Q4 GGUF), 2 threads, eager forwards (the catch-up runs the
head eagerly on any path).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from verispec.bench import harness

sys.path.insert(0, str(Path(__file__).resolve().parent))      # draft_level_cost's head loader

WINDOWS = (0, 512, 256, 128, 64, 32)          # 0: the whole prompt
CATEGORIES = ("rag", "summarization", "extraction", "stem")
PROMPT_LENGTHS = (256, 512, 1024)


def acceptance(target, max_tokens: int, per: int, windows: tuple[int, ...]) -> dict:
    """{window: {"tokens": n, "steps": s}} over the long-prompt questions; outputs must agree."""
    from verispec import LLM, SamplingParams
    from verispec.data import spec_bench_questions
    qs = spec_bench_questions()
    prompts = [q for c in CATEGORIES for q in [q for q in qs if q["category"] == c][2:2 + per]]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    out, first = {}, None
    for w in windows:
        llm = LLM(loaded=target, speculative_config={"method": "eagle3", "num_speculative_tokens": 3,
                                                     "adaptive_drafting": False, "head_context": w},
                  max_num_seqs=len(prompts))
        done = llm.chat([[{"role": "user", "content": q["turns"][0]}] for q in prompts], params)
        ids = [o.token_ids for o in done]
        if first is not None and ids != first:
            raise RuntimeError(f"window {w}: outputs differ from the whole prompt's (not lossless)")
        first = ids if first is None else first
        out[str(w)] = {"tokens": sum(len(i) for i in ids), "steps": sum(o.metrics.num_steps for o in done)}
        print(f"window {w}: {out[str(w)]}", flush=True)
    return {"questions": [q["question_id"] for q in prompts], "windows": out}


def first_step_ms(head, window: int, prompt: int, reps: int) -> float:
    """Fastest ms of a new request's first propose after a ``prompt``-token prompt (zero features)."""
    import torch
    from verispec.core.features import TargetFeatures
    from verispec.core.params import SamplingParams
    from verispec.drafting.base import DraftRequest
    from verispec.drafting.dynamic_tree import StaticTreeConfig
    from verispec.drafting.eagle import EagleDrafter
    h = torch.zeros(prompt, head.cfg.target_hidden_size, dtype=head.embed_tokens.dtype)
    feats = TargetFeatures({i: h for i in head.hidden_layers}, h if head.needs_last_hidden else None)
    best = float("inf")
    drafter = EagleDrafter(head, StaticTreeConfig.chain(1), max_batch=1, max_len=prompt + 16,
                           context_window=window or None)
    ctx = [1] * (prompt + 1)
    for _ in range(reps):
        drafter.start(0, ctx[:-1], feats)
        req = DraftRequest(0, ctx, SamplingParams(), torch.Generator())
        t = time.perf_counter()
        with torch.no_grad():
            drafter.propose([req])
        best = min(best, time.perf_counter() - t)
        drafter.release(0)
    return best * 1e3


def costs(target, model: str, reps: int, windows: tuple[int, ...]) -> dict:
    """{prompt length: {window: ms}} of the first draft step."""
    from draft_level_cost import load_head
    head = load_head(target, "eagle3", model)
    return {str(p): {str(w): first_step_ms(head, w, p, reps) for w in windows} for p in PROMPT_LENGTHS}


def measure(args: argparse.Namespace) -> dict:
    import torch
    from verispec.models.loading import load_model
    torch.set_num_threads(2)
    target = load_model(args.model, weights="int4")
    windows = tuple(int(w) for w in args.windows.split(","))
    return {"machine": harness.machine_record(), "model": args.model, "reps": args.reps,
            "max_tokens": args.max_tokens, "acceptance": acceptance(target, args.max_tokens, args.per_category, windows),
            "first_step_ms": costs(target, args.model, args.reps, windows)}


def render(res: dict) -> str:
    acc, cost = res["acceptance"]["windows"], res["first_step_ms"]
    name = lambda w: "whole prompt" if w == "0" else w      # noqa: E731
    lines = [f"`{res.get('model', 'smollm2-135m')}` int4, its shipped EAGLE-3 head (packed int4), 2 threads, "
             "eager forwards.", "",
             f"## Acceptance: a fixed 3-chain every step, {res['max_tokens']} new tokens, greedy",
             "", f"Spec-Bench questions {res['acceptance']['questions']} (from the third of {', '.join(CATEGORIES)}); "
             "all in one batch; every window's outputs identical.", "",
             "| head_context | tokens | steps | tokens per step |", "|---|---|---|---|"]
    for w, a in acc.items():
        lines.append(f"| {name(w)} | {a['tokens']} | {a['steps']} | {a['tokens'] / a['steps']:.3f} |")
    lines += ["", f"## First draft step of a request (catch-up and a one-node chain), ms, fastest of {res['reps']}",
              "", "| prompt tokens | " + " | ".join(name(w) for w in next(iter(cost.values()))) + " |",
              "|---|" + "---|" * len(next(iter(cost.values())))]
    for p, row in cost.items():
        lines.append(f"| {p} | " + " | ".join(f"{v:.1f}" for v in row.values()) + " |")
    return "\n".join(lines)


OUT = harness.Output("head_context", "EAGLE head context window: acceptance and first-step cost", render,
                     model="smollm2-135m")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--per-category", type=int, default=4, help="questions per category, from the third")
    ap.add_argument("--windows", default=",".join(map(str, WINDOWS)), help="head_context values (0: all)")
    OUT.main(ap, measure)


if __name__ == "__main__":
    main()
