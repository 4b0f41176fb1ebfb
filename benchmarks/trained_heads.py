"""The shipped draft heads on Spec-Bench: ``python benchmarks/trained_heads.py`` (about 30 min on 2 cores).

Three suites on smollm2-135m (fp32) with the heads in ``checkpoints/``, written to
``benchmarks/results/trained_heads/``:

* ``heads``: vanilla, eagle3 (EAGLE-2 dynamic tree, defaults topk 8 / depth 6 / 12 nodes),
  eagle3-small (topk 4 / depth 4 / 6 nodes: fewer verify tokens, cheaper on a CPU), medusa
  (default static tree), on one question per Spec-Bench category (13; the MT-bench ones with both
  turns), 128 new tokens per turn, greedy, batch 1: the numbers the training issue asks for.
* ``eagle2-ablation``: full dynamic tree, no reranking, confidence only, neither, on 4 categories,
  64 tokens.
* ``batch-sweep``: vanilla and eagle3 at batch 1, 4, 8 on 2 categories (summarization, qa),
  64 tokens (questions repeated to fill a batch).
* ``cpu-default``: what a user gets by default on this CPU (issue 22's numbers): fp16-packed
  weights, Spec-Bench, 2 questions in each of the 13 categories, 128 new tokens per turn, greedy,
  batch 1; vanilla, eagle3 and eagle and medusa with their default configs (a head carrying an
  ``acceptance.json`` profile gets the tree chosen from this machine's measured costs; the report
  lists the chosen shapes) and eagle3-dynamic (EAGLE-2's dynamic tree, topk 8, depth 6, for
  reference). ``python benchmarks/trained_heads.py --suites cpu-default`` (about 10 min).
* ``cpu-compiled``: ``cpu-default`` with compiled forwards (``compile=True``: the fastest fp16
  configuration; the heads' shapes are chosen from the compiled forward's costs), plus ngram-x1
  (prompt lookup with one extra token) for reference. ``--suites cpu-compiled`` (about 12 min).
* ``cpu-adaptive``: ``cpu-compiled``'s setup; each head with its default config (adaptive drafting:
  a request drafts only while its acceptance beats the measured break-even, ``draft_gate``) and
  with ``adaptive_drafting: false`` (``-fixed``: every step drafts the chosen shape).
  ``--suites cpu-adaptive`` (about 13 min).
* ``heads-fp16``: the heads with fp16-packed weights (target and heads), 64 tokens per turn:
  vanilla, eagle3 (default dynamic tree), eagle3-cpu (topk 2 / depth 3 / 4 nodes, the demo's),
  eagle3-chain (a chain of 3), eagle (EAGLE-1, default static tree), medusa.

Run after ``benchmarks/spec_bench.py`` (the other methods and peers) on the same questions;
vanilla runs in every suite, so each ratio is from one process. ``--rerender`` rebuilds the report.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch is imported

from verispec.bench import harness  # noqa: E402
from verispec.bench.runner import BenchConfig  # noqa: E402
from verispec.bench.suite_main import suite_main  # noqa: E402

OUT = harness.RESULTS / "trained_heads"      # results.json, report.md and plots (``verispec bench``'s report)
NOTE = ("Shared 2-core VM (other jobs of this session may compete; load averages in results.json). "
        "All methods run interleaved per question in one process; ratios are the numbers to read.")
SUBSET = ("translation", "summarization", "qa", "math_reasoning")


def suites(threads: int) -> list[BenchConfig]:
    common = dict(model="smollm2-135m", dtype="float32", threads=threads, hf_weights="loader",
                  temperature=0.0, repeats=1, warmup_tokens=16, notes=NOTE)
    small = {"method": "eagle3", "topk": 4, "depth": 4, "num_draft_tokens": 6}
    return [
        BenchConfig(name="heads", methods=("vanilla", "eagle3", "eagle3-small", "medusa"),
                    method_configs={"eagle3-small": small}, per_category=1, max_tokens=128,
                    batch_sizes=(1,), **common),
        BenchConfig(name="eagle2-ablation", methods=("vanilla",), preset="eagle2-ablation", categories=SUBSET,
                    per_category=1, max_tokens=64, batch_sizes=(1,), **common),
        BenchConfig(name="heads-fp16", methods=("vanilla", "eagle3", "eagle3-cpu", "eagle3-chain", "eagle", "medusa"),
                    method_configs={"eagle3-cpu": {"method": "eagle3", "topk": 2, "depth": 3, "num_draft_tokens": 4},
                                    "eagle3-chain": {"method": "eagle3", "topk": 1, "depth": 3, "num_draft_tokens": 3}},
                    per_category=1, max_tokens=64, batch_sizes=(1,), weights="fp16", **common),
        BenchConfig(name="cpu-default", methods=("vanilla", "eagle3", "eagle3-dynamic", "eagle", "medusa"),
                    method_configs={"eagle3-dynamic": {"method": "eagle3", "topk": 8, "depth": 6}},
                    per_category=2, max_tokens=128, batch_sizes=(1,), weights="fp16", **common),
        BenchConfig(name="cpu-compiled", methods=("vanilla", "eagle3", "eagle", "medusa", "ngram-x1"),
                    method_configs={"ngram-x1": {"method": "ngram", "num_speculative_tokens": 5,
                                                 "prompt_lookup_extra": 1}},
                    per_category=2, max_tokens=128, batch_sizes=(1,), weights="fp16", compile=True, **common),
        BenchConfig(name="cpu-adaptive", methods=("vanilla", "eagle3", "eagle3-fixed", "eagle", "eagle-fixed",
                                                  "medusa", "medusa-fixed"),
                    method_configs={f"{m}-fixed": {"method": m, "adaptive_drafting": False}
                                    for m in ("eagle3", "eagle", "medusa")},
                    per_category=2, max_tokens=128, batch_sizes=(1,), weights="fp16", compile=True, **common),
        BenchConfig(name="batch-sweep", methods=("vanilla", "eagle3"), categories=SUBSET[1:3], per_category=1,
                    max_tokens=64, batch_sizes=(1, 4, 8), **common),
    ]


def main(argv: list[str] | None = None) -> int:
    return suite_main(argv, suites, OUT, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
