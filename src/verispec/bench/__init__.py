"""Spec-Bench-style benchmark: speedup and acceptance of every method on the same prompts.

    BenchConfig ──► runner.run_benchmark ──► BenchResult (raw records) ──► report.write_report
                    (methods interleaved per prompt,                       (results.json, report.md,
                     peers from ``peers``)                                  PNG plots; atomic writes)

Entry points: ``run_benchmark(BenchConfig(...))`` and ``write_report(out_dir, results)``; the
shared record types live in ``records`` (re-exported here).
"""
from __future__ import annotations

from .records import (KINDS, PEER_KINDS, BenchError, BenchResult, FidelityRecord, GenResult, MethodSpec, RunRecord,
                      stats_dict)
from .report import summarize, write_report
from .runner import BenchConfig, run_benchmark

__all__ = ["BenchConfig", "BenchError", "BenchResult", "FidelityRecord", "GenResult", "KINDS", "MethodSpec",
           "PEER_KINDS", "RunRecord", "run_benchmark", "stats_dict", "summarize", "write_report"]
