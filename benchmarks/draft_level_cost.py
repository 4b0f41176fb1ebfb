"""The EAGLE-3 drafter's own step cost, before and after a change (#22 item 6).

``draft_costs`` (what the shape chooser measures: accept one token, then propose) of the shipped
SmolLM2-135M EAGLE-3 head on the fp16-packed target, 2 threads: the fixed cost (catch-up, which
also ranks depth 1) and the cost of one more level over w = 1, 2, 4, 8 nodes. One worker process
per source tree (``--src DIR``, put first on ``PYTHONPATH``), interleaved round by round; medians
over rounds of each round's fastest-of-``--reps`` timing.

    python benchmarks/draft_level_cost.py --src /path/before/src --label before --src src --label after

Writes benchmarks/results/draft_level_cost.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def worker(reps: int) -> dict:
    import torch

    from verispec.drafting.eagle import draft_costs
    from verispec.drafting.eagle_head import HeadKind
    from verispec.formats import load_eagle_head
    from verispec.models.loading import load_model
    torch.set_num_threads(2)
    target = load_model("smollm2-135m", weights="fp16")
    head = load_eagle_head(str(ROOT / "checkpoints" / "smollm2-135m-eagle3"), target.model, HeadKind.EAGLE3)
    head.pack_fp16_(target.model.lm_head)
    fixed, levels = draft_costs(head, reps=reps)
    return {"fixed_ms": fixed, **{f"level_w{w}_ms": ms for w, ms in levels}}


def main() -> None:
    from interleave import add_arguments, run_rounds          # benchmarks/ (this script's folder)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap, rounds=5, out=str(HERE / "results" / "draft_level_cost"))
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.reps)))
        return
    runs = run_rounds(__file__, a.src, a.label, a.rounds, ["--reps", str(a.reps)])
    keys = list(runs[a.label[0]][0])
    med = {lab: {k: statistics.median(x[k] for x in runs[lab]) for k in keys} for lab in a.label}
    from machine import machine_line          # benchmarks/ (this script's folder)
    machine = machine_line()
    Path(a.out + ".json").write_text(json.dumps({"machine": machine, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                                 "rounds": a.rounds, "reps": a.reps, "runs": runs, "median": med}, indent=1))
    lines = ["# EAGLE-3 drafter step cost: before / after", "",
             f"Machine: {machine}. SmolLM2-135M fp16-packed with the shipped EAGLE-3 head, 2 threads, batch 1, "
             f"256-token context; `draft_costs` (accept one token + propose), fastest of {a.reps} per round, "
             f"median over {a.rounds} interleaved rounds.", "",
             "| cost | " + " | ".join(f"{lab} ms" for lab in a.label) + " | change |", "|---|" + "---|" * (len(a.label) + 1)]
    for k in keys:
        vals = [med[lab][k] for lab in a.label]
        lines.append(f"| {k.removesuffix('_ms').replace('_', ' ')} | " + " | ".join(f"{v:.2f}" for v in vals) +
                     f" | {vals[-1] / vals[0] - 1:+.0%} |")
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
