"""The command-line body of the Spec-Bench scripts in ``benchmarks/`` (spec_bench.py,
trained_heads.py): their result is ``verispec bench``'s report, a folder (results.json, report.md,
plots) written by ``report.write_report`` through ``harness.atomic_write``, with the harness's
machine record (``runner.machine_info``)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from .report import created_utc, headline, load_results, summarize, write_report
from .runner import BenchConfig, run_benchmark


def suite_main(argv: list[str] | None, suites: Callable[[int], list[BenchConfig]], out: Path,
               description: str) -> int:
    """Run ``suites(threads)`` (or only ``--suites NAME...``), write results.json, report.md and
    plots to ``--out``; ``--rerender`` rebuilds the report from results.json. ``analysis.md`` in
    the output folder (hand-written, if present) goes into report.md."""
    from ..models.loading import load_model
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", type=Path, default=out, help=f"output folder (default {out})")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--suites", nargs="*", help="names of the suites to run (default: all)")
    ap.add_argument("--rerender", action="store_true",
                    help="rewrite report.md and plots from the existing results.json (no run)")
    args = ap.parse_args(argv)
    notes, created = args.out / "analysis.md", None
    if args.rerender:
        results, created = load_results(args.out / "results.json"), created_utc(args.out / "results.json")
    else:
        configs = [c for c in suites(args.threads) if not args.suites or c.name in args.suites]
        targets: dict[tuple, object] = {}        # one load per (model, dtype, weights)
        runs = []
        for c in configs:
            key = (c.model, c.dtype, c.weights)
            if key not in targets:
                targets[key] = load_model(c.model, dtype=c.dtype, weights=c.weights)
            runs.append(run_benchmark(c, loaded=targets[key]))
        results = merge_suites(args.out / "results.json" if args.suites else None, runs)
    files = write_report(args.out, results, notes.read_text() if notes.is_file() else "", created)
    for r in results:
        print(f"\n{r.name}:\n{headline(r, summarize(r))}")
    print("\nwrote " + ", ".join(str(f) for f in files))
    return 0


def merge_suites(existing: Path | None, new: list) -> list:
    """``new`` suites merged into those of ``existing`` (a results.json, if it exists): a suite
    of the same name is replaced in place, the others are appended."""
    if existing is None or not existing.is_file():
        return new
    merged = {r.name: r for r in load_results(existing)}
    merged.update({r.name: r for r in new})
    return list(merged.values())
