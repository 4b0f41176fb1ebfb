"""The committed Spec-Bench-style run: ``python benchmarks/spec_bench.py`` (about 75 min on 2 cores).

Four suites on smollm2-135m (fp32), written together to ``benchmarks/results/spec_bench/``:

* ``main``: vanilla, ngram, draft_model (self-draft), hf, hf-pld on one question per Spec-Bench
  category (13 questions, the 8 MT-bench ones with both turns), 128 new tokens per turn, batch 1.
* ``batch-sweep``: vanilla and ngram on 4 single-turn questions (translation, summarization, qa,
  math_reasoning), 64 new tokens, batch sizes 1, 4, 8 (category-pure batches, questions repeated
  to fill them): where speculation stops paying.
* ``eagle-assisted``: vanilla, eagle (the shipped EAGLE-1 head, static tree), hf and hf-assisted
  (HF assisted generation, the assistant the first 7 of 30 target layers with the target's head:
  the same self-draft as ``draft_model``, 4 tokens a step) on the 13 questions of ``main``.
  (The shipped EAGLE-3 and Medusa heads run in ``benchmarks/trained_heads.py``.)
* ``batch-sweep-fp16``: ``batch-sweep`` with fp16-packed weights (``--weights fp16``; vanilla with
  the same weights is the baseline) and ngram k=4: where speculation stops paying once a
  few-token verification forward costs about a one-token one.

``--suites NAME`` reruns one suite and keeps the others in results.json.

The settings below are the committed ones; flags only change where the files go and the threads.
``analysis.md`` in the output folder (hand-written, if present) goes into report.md;
``--rerender`` rebuilds report.md and the plots from results.json without running anything.
``OMP_WAIT_POLICY=PASSIVE`` is set (unless already set) before torch loads: on a machine whose
cores are shared with other jobs, OpenMP's default spin-waiting made 2 threads 5-8x slower than 1.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch is imported (see above)

from verispec.bench import harness  # noqa: E402
from verispec.bench.runner import BenchConfig  # noqa: E402
from verispec.bench.suite_main import suite_main  # noqa: E402

OUT = harness.RESULTS / "spec_bench"      # results.json, report.md and plots (``verispec bench``'s report)
NOTE = ("Measured on a shared 2-core VM while other engineers' builds and tests competed for the "
        "same cores (load averages below and in results.json). Absolute tokens/s are depressed and "
        "noisy; the ratios are sturdier because all methods run interleaved per question in one "
        "process. OMP_WAIT_POLICY=PASSIVE: with OpenMP's default spin-waiting, 2 threads on the "
        "oversubscribed cores ran 5-8x slower than 1 thread.")


def suites(threads: int) -> list[BenchConfig]:
    common = dict(model="smollm2-135m", dtype="float32", threads=threads, hf_weights="loader",
                  temperature=0.0, repeats=1, warmup_tokens=16, notes=NOTE)
    return [
        BenchConfig(name="main", methods=("vanilla", "ngram", "draft_model", "hf", "hf-pld"),
                    per_category=1, max_tokens=128, batch_sizes=(1,), **common),
        BenchConfig(name="batch-sweep", methods=("vanilla", "ngram"),
                    categories=("translation", "summarization", "qa", "math_reasoning"), per_category=1,
                    max_tokens=64, batch_sizes=(1, 4, 8), **common),
        BenchConfig(name="eagle-assisted", methods=("vanilla", "eagle", "hf", "hf-assisted"),
                    per_category=1, max_tokens=128, batch_sizes=(1,), **common),
        BenchConfig(name="batch-sweep-fp16", methods=("vanilla", "ngram"),
                    method_configs={"ngram": {"method": "ngram", "num_speculative_tokens": 4}},
                    categories=("translation", "summarization", "qa", "math_reasoning"), per_category=1,
                    max_tokens=64, batch_sizes=(1, 4, 8), weights="fp16", **common),
    ]


def main(argv: list[str] | None = None) -> int:
    return suite_main(argv, suites, OUT, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
