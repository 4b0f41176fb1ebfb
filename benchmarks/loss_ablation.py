"""Which EAGLE-3 training loss raises on-policy acceptance most for equal wall time (issue 37 item 3).

Each arm warm-starts from the shipped SmolLM2 EAGLE-3 head and trains the same number of steps
on the same data (answers the int4 target wrote itself, features from the int4 target), TTT 3,
batch 8, lr 3e-4 with 3% warm-up on a 600-step cosine schedule, bf16 autocast, 2 threads; only
``--loss`` differs (``train.eagle3.DraftLoss``: soft, hard, lk, soft+hard). Equal steps are equal
wall time here (every loss costs the same softmax over the draft vocabulary; the table shows the
measured time). The shipped head, evaluated on the same held-out split, is the baseline.

    python benchmarks/loss_ablation.py --data runs/smollm2-int4/regen.jsonl [--steps 40] [--losses soft,hard,lk]
    python benchmarks/loss_ablation.py --report-only     # tabulate the runs already in runs/abl-*

Writes benchmarks/results/loss_ablation.{json,md}. Runs live in runs/abl-<loss> (resumable).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from verispec.bench import harness

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
HEAD = ROOT / "checkpoints" / "smollm2-135m-eagle3"
COMMON = ["--heldout-fraction", "0.05", "--ttt-length", "3", "--max-length", "512", "--micro-batch-size", "4",
          "--target-weights", "int4", "--threads", "2", "--quiet"]


def run_dir(loss: str) -> Path:
    return ROOT / "runs" / f"abl-{loss.replace('+', '_')}"


def train_arm(data: str, loss: str, steps: int) -> None:
    cmd = [sys.executable, "-m", "verispec.cli", "train", "eagle3", "--data", data, "--init-from", str(HEAD),
           "--out", str(run_dir(loss)), "--batch-size", "8", "--lr", "3e-4", "--warmup-ratio", "0.03",
           "--dtype", "bf16", "--max-steps", "600", "--stop-after", str(steps), "--loss", loss,
           "--log-every", "5", "--save-every", "20", *COMMON]
    subprocess.run(cmd, check=True, cwd=ROOT)


def eval_baseline(data: str) -> None:
    cmd = [sys.executable, "-m", "verispec.cli", "train", "eagle3", "--data", data, "--init-from", str(HEAD),
           "--eval-only", "--out", str(ROOT / "runs" / "eval-shipped"), *COMMON]
    subprocess.run(cmd, check=True, cwd=ROOT)


def arm_result(loss: str) -> dict | None:
    log = run_dir(loss) / "log.jsonl"
    if not log.exists():
        return None
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    ev = [r for r in recs if "eval" in r]
    train = [r for r in recs if "eval" not in r]
    if not ev:
        return None
    e = ev[-1]["eval"]
    return {"loss": loss, "steps": ev[-1]["step"], "wall_s": train[-1]["elapsed_s"] if train else None,
            **{f"acc{i}": e[f"acc{i}"] for i in range(3)}}


def render(results: dict) -> str:
    lines = [results["workload"], "",
             "| loss | steps | wall time | held-out acc@0 | acc@1 | acc@2 |", "|---|---|---|---|---|---|"]
    b = results["baseline"]
    lines.append(f"| shipped head, before (no training) | 0 | - | {b['acc0']:.3f} | {b['acc1']:.3f} | {b['acc2']:.3f} |")
    for r in results["arms"]:
        lines.append(f"| `{r['loss']}` | {r['steps']} | {r['wall_s'] / 60:.1f} min | {r['acc0']:.3f} | "
                     f"{r['acc1']:.3f} | {r['acc2']:.3f} |")
    lines += ["", results["reading"]]
    return "\n".join(lines)


OUT = harness.Output("loss_ablation", "EAGLE-3 loss ablation, equal steps", render)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="runs/smollm2-int4/regen.jsonl")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--losses", default="soft,hard,lk")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--reading", default="", help="the conclusion line written under the table")
    a = OUT.parse(ap)
    if a is None:
        return
    losses = a.losses.split(",")
    machine = harness.machine_record()
    if not a.report_only:
        for loss in losses:
            train_arm(a.data, loss, a.steps)
        eval_baseline(a.data)
    base = json.loads((ROOT / "runs" / "eval-shipped" / "eval.json").read_text())
    arms = [r for r in (arm_result(x) for x in losses) if r is not None]
    results = {"machine": machine,
               "workload": (f"SmolLM2-135M int4 target; {a.data}: answers the int4 target wrote itself to ShareGPT "
                            "prompts, 5% held out by id; warm start from the shipped head; TTT 3, batch 8, lr 3e-4 "
                            "(600-step cosine schedule, 3% warm-up), bf16, 2 threads; acc@i = top-1 agreement with "
                            "the target at tree depth i+1 on the held-out split (TTT evaluation)."),
               "baseline": {f"acc{i}": base[f"acc{i}"] for i in range(3)}, "arms": arms, "reading": a.reading}
    print(OUT.write(results, a.out).read_text())


if __name__ == "__main__":
    main()
