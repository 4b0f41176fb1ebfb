"""The soak with faults (benchmarks/soak.py) in short: concurrent users with speculation on, mixed
streaming / dropped / malformed / oversized requests and a burst above the queue limit, then a
kill -9 mid-load and a restart. No 5xx, greedy outputs equal their solo runs, every row and queue
slot free at the end, no client hangs, the restarted server serves."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
SOAK = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


def _soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check(rep: dict) -> None:
    load, kill = rep["load"], rep["kill"]
    assert load["status_5xx"] == 0, load["by_outcome"]
    assert not load["greedy_outputs_differing_from_solo"] and load["greedy_prompts"] >= 2
    assert load["running_at_end"] == 0 and load["waiting_at_end"] == 0
    assert any(k.startswith("burst:429") for k in load["by_outcome"]), load["by_outcome"]     # the queue limit held
    assert any(k.startswith(("drop:", "malformed:400", "oversized:400")) for k in load["by_outcome"])
    assert kill["clients_hung"] == 0 and kill["client_errors"] and kill["restarted_status"] == 200


def test_short_soak_with_faults():
    soak = _soak()
    _check(soak.run(soak.parse_args(["--duration", "12", "--users", "6", "--burst", "30", "--max-queue", "8",
                                     "--kill-after", "2", "--max-num-seqs", "4", "--no-compile"])))


@pytest.mark.slow
def test_long_soak_with_faults():
    soak = _soak()
    _check(soak.run(soak.parse_args(["--duration", "180", "--users", "32", "--max-queue", "32"])))
