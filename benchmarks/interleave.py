"""Before/after runs of one benchmark over several verispec source trees: one worker subprocess
per tree (``PYTHONPATH`` = the tree's ``src``), the trees in turns round by round so that a burst
of other work on the machine falls on every tree alike."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_rounds(script: str, srcs: list[str], labels: list[str], rounds: int, args: list[str],
               env: dict | None = None) -> dict[str, list[dict]]:
    """``{label: [worker JSON per round]}``; each worker is ``script --worker *args`` and prints
    its result as JSON on its last line."""
    if len(srcs) != len(labels):
        raise SystemExit(f"{len(srcs)} --src but {len(labels)} --label")
    runs: dict[str, list[dict]] = {lab: [] for lab in labels}
    for r in range(rounds):
        for src, lab in zip(srcs, labels):
            e = dict(os.environ, PYTHONPATH=str(Path(src).resolve()), **(env or {}))
            res = subprocess.run([sys.executable, script, "--worker", *args], env=e, capture_output=True,
                                 text=True, check=True)
            runs[lab].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {lab}: done", flush=True)
    return runs


def add_arguments(ap, rounds: int, out: str) -> None:
    """The driver's options: ``--src``/``--label`` (repeat, in pairs), ``--rounds``, ``--out``, and
    the hidden ``--worker`` switch that makes the script one tree's worker."""
    import argparse
    ap.add_argument("--src", action="append", default=[], help="a verispec src folder (repeat)")
    ap.add_argument("--label", action="append", default=[], help="a name for each --src")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=out, help="results path without extension")
