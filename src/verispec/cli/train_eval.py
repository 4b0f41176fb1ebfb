"""``verispec train ... --eval-only``: held-out statistics of a head and the acceptance profile
(``draft_shape.AcceptanceProfile``) they give; shared by every trainer's command."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def eval_only(args: argparse.Namespace, trainer, n_heldout: int, depth: int | None = None) -> int:
    """Held-out statistics of the ``--init-from`` head at ``--ttt-length`` steps, to
    ``<out>/eval.json``; nothing is trained."""
    import json
    if n_heldout == 0:
        raise SystemExit("--eval-only needs held-out data (--heldout-fraction > 0)")
    depth = args.ttt_length if depth is None else depth
    ev = {"head": args.init_from, "depth": depth, "heldout_sequences": n_heldout,
          **trainer.evaluate()}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "eval.json").write_text(json.dumps(ev, indent=1))
    profile = acceptance_profile(ev, depth, f"held-out eval of {args.init_from}")
    if profile is not None:
        path = profile.save(args.out, head=str(args.init_from), heldout_sequences=n_heldout,
                            data=[str(d) for d in args.data])
        print(f"acceptance profile (depth x rank) -> {path}; copy it into the head folder to let "
              "the default speculative config choose its tree from measured costs", file=sys.stderr)
    print(json.dumps(ev))
    return 0


def acceptance_profile(ev: dict, ttt_length: int, source: str):
    """The ``draft_shape.AcceptanceProfile`` of an evaluation's ``hit{i}@{k}`` rates (depths with
    no valid position are left out at the end); None when there are none."""
    import math

    from ..drafting.draft_shape import AcceptanceProfile
    rows = []
    for i in range(ttt_length):
        row = [ev.get(f"hit{i}@{k}") for k in range(1, 9)]
        if row[0] is None or any(v is None or math.isnan(v) for v in row):
            break
        rows.append(row)
    return AcceptanceProfile.from_hits(rows, source) if rows else None
