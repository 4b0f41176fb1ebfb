"""What one draft step of each shipped head costs, by how its matmuls are packed (issue 37 item 1).

The shipped SmolLM2-135M heads beside the int4 target (the fast path, ``weights="auto"``), 2
threads, batch 1, 256-token context. Per head and packing (fp16: what heads ran before; int8; int4:
what a head beside an int4 target runs now), the costs the shape chooser measures
(``drafting.eagle.draft_costs`` / ``drafting.medusa.draft_cost``: accept one token, then propose):
the fixed cost (EAGLE: the catch-up, which also ranks depth 1; Medusa: every depth at once) and,
for EAGLE heads, the cost of one more level over w = 1, 2, 4, 8 nodes. Each timing is the fastest of
``--reps`` steps after a target forward (cold caches, as in an engine); the packings are timed in
turns, ``--rounds`` times, and the median of the rounds is reported.

    python benchmarks/draft_level_cost.py [--rounds 5] [--reps 15]

Writes benchmarks/results/draft_level_cost.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
PACKINGS = ("fp16", "int8", "int4")
HEADS = {"eagle3": "smollm2-135m-eagle3", "eagle": "smollm2-135m-eagle", "medusa": "smollm2-135m-medusa"}


def load_heads(target, reps: int, between):
    """{(head, packing): timing function -> (fixed ms, ((w, level ms), ...))} over the shipped
    heads and PACKINGS."""
    from verispec.core.params import SamplingParams  # noqa: F401  (the drafters' imports)
    from verispec.drafting.draft_vocab import head_vocab
    from verispec.drafting.eagle import draft_costs
    from verispec.drafting.eagle_head import HeadKind
    from verispec.drafting.medusa import draft_cost
    from verispec.formats import load_eagle_head, load_medusa_heads
    out = {}
    for name, folder in HEADS.items():
        path = str(ROOT / "checkpoints" / folder)
        for packing in PACKINGS:
            if name == "medusa":
                head = load_medusa_heads(path, target.model)
                time_it = lambda h=head: (draft_cost(h, reps=reps, between=between), ())   # noqa: E731
            else:
                kind = HeadKind.EAGLE3 if name == "eagle3" else HeadKind.EAGLE1
                head = load_eagle_head(path, target.model, kind)
                time_it = lambda h=head: draft_costs(h, reps=reps, between=between)        # noqa: E731
            vocab = head_vocab(None, path, head.cfg.vocab_size)
            if vocab is not None:
                head.restrict_vocab_(vocab.draft_ids)
            head.pack_(packing, target.model.lm_head)
            out[(name, packing)] = time_it
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=str(HERE / "results" / "draft_level_cost"))
    a = ap.parse_args()
    import torch

    from machine import machine_line
    from verispec.models.loading import load_model
    torch.set_num_threads(2)
    target = load_model("smollm2-135m", weights="int4")
    from verispec.drafting.draft_shape import target_step
    timers = load_heads(target, a.reps, target_step(target.model))
    runs: dict[str, list[dict]] = {}
    for r in range(a.rounds):
        for (name, packing), time_it in timers.items():
            fixed, levels = time_it()
            runs.setdefault(f"{name}/{packing}", []).append({"fixed_ms": fixed, **{f"w{w}": ms for w, ms in levels}})
        print(f"round {r + 1}/{a.rounds} done", flush=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in runs.items()}
    machine = machine_line()
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    Path(a.out + ".json").write_text(json.dumps({"machine": machine, "date": date, "rounds": a.rounds,
                                                 "reps": a.reps, "runs": runs, "median": med}, indent=1))
    Path(a.out + ".md").write_text(render(med, machine, date, a.rounds, a.reps))
    print(Path(a.out + ".md").read_text())


def render(med: dict, machine: str, date: str, rounds: int, reps: int) -> str:
    lines = ["# Draft step cost by head packing", "",
             f"Machine: {machine}; {date}. SmolLM2-135M with int4 weights (the default fast path), the shipped "
             f"heads, 2 threads, batch 1, 256-token context; fastest of {reps} steps, median of {rounds} "
             "rounds, packings in turns. Fixed: EAGLE's catch-up (ranks depth 1), Medusa's every depth at "
             "once. Level w: one more EAGLE level over w nodes. All in ms.", "",
             "| head | packing | fixed | level w=1 | w=2 | w=4 | w=8 |", "|---|---|---|---|---|---|---|"]
    for key, m in med.items():
        name, packing = key.split("/")
        cells = [f"{m[f'w{w}']:.2f}" if f"w{w}" in m else "-" for w in (1, 2, 4, 8)]
        lines.append(f"| {name} | {packing} | {m['fixed_ms']:.2f} | " + " | ".join(cells) + " |")
    lines += ["", "Heads beside an int4 target are packed int4 (`models.draft_packing`); before, every "
              "head was fp16-packed. A draft's numbers need not match the target's: each drafted token is "
              "verified, so outputs stay the target's."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
