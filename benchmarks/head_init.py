"""The EAGLE-3 training ablation of #22 item 4: new heads trained from scratch for the same wall
time, compared by on-policy held-out acc@0..k. Reads finished `verispec train eagle3` run folders
(their ``log.jsonl`` and ``train_meta.json``) and writes the table; the runs themselves are the
long job (commands in the table).

    python benchmarks/head_init.py --run target=/work/runs/abl/target --run random=/work/runs/abl/random ...

Each arm's wall time is the trainer's own ``elapsed_s`` at its last step; arms run in pairs on
one thread each, so two arms of a pair share the machine the same way. Writes
benchmarks/results/head_init.{json,md}.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from verispec.bench import harness


def read_run(folder: Path, step: int | None = None) -> dict:
    """Held-out eval (the final one, or the one at ``step``), steps and wall time of a finished run
    folder; the wall time is the trainer's ``elapsed_s`` at the last logged step up to it."""
    logs = [json.loads(x) for x in (folder / "log.jsonl").read_text().splitlines() if x.strip()]
    evals = [x for x in logs if "eval" in x and (x.get("final") if step is None else x["step"] == step)]
    if not evals:
        raise SystemExit(f"{folder}: no {'final ' if step is None else f'step-{step} '}evaluation in log.jsonl")
    at = evals[-1]["step"]
    timed = [x for x in logs if "elapsed_s" in x and x["step"] <= at]
    meta = json.loads((folder / "train_meta.json").read_text())
    ev = evals[-1]["eval"]
    return {"steps": at, "wall_s": timed[-1]["elapsed_s"] if timed else None,
            "loss": ev["loss"], "acc": [ev[f"acc{i}"] for i in range(16) if f"acc{i}" in ev],
            "command": meta.get("command", "")}


def render(res: dict) -> str:
    depth = max(len(r["acc"]) for r in res["arms"].values())
    head = "| arm | steps | wall min | held-out loss | " + " | ".join(f"acc@{i}" for i in range(depth)) + " |"
    lines = [res["note"], "", head,
             "|" + "---|" * (4 + depth)]
    for name, r in res["arms"].items():
        accs = [f"{a:.3f}" for a in r["acc"]] + ["–"] * (depth - len(r["acc"]))
        wall = f"{r['wall_s'] / 60:.1f}" if r["wall_s"] is not None else "–"
        lines.append(f"| {name} | {r['steps']} | {wall} | {r['loss']:.2f} | " + " | ".join(accs) + " |")
    lines += ["", "Commands:", ""] + [f"- {name}: `{r['command']}`" for name, r in res["arms"].items()]
    return "\n".join(lines)


OUT = harness.Output("head_init", "EAGLE-3 head training ablation: initialisation and TTT length (same wall time)",
                     render)


def read_arms(args) -> dict:
    arms = {}
    for spec in args.run:
        name, _, folder = spec.partition("=")
        if not folder:
            raise SystemExit(f"--run takes name=folder, got {spec!r}")
        folder, _, step = folder.partition("@")
        arms[name] = read_run(Path(folder), int(step) if step else None)
    return {"machine": harness.machine_record(), "note": args.note, "arms": arms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", action="append", help="name=folder of a finished run (repeat; "
                    "name=folder@STEP: its evaluation at STEP)")
    ap.add_argument("--note", default="", help="how the arms ran (pairs, threads, load)")
    OUT.main(ap, lambda args: read_arms(args) if args.run else ap.error("--run is required"))


if __name__ == "__main__":
    main()
