"""What bounds the shipped SmolLM2-135M heads on this machine: measured step costs, and the
acceptance a head would need for the speed-ups issue #22 asks for.

One process, fp16-packed SmolLM2-135M, 2 threads. Measured here, in this run (``draft_shape``'s
own timers, fastest of ``--reps``):
- V(T): the target's verify forward over T tokens after a 256-token context (with the EAGLE-3
  head's feature layers requested, as in decoding);
- the EAGLE-3 head's fixed draft cost (catch-up on one accepted token, which also ranks depth 1)
  and the cost of one more level over w nodes; the Medusa heads' one forward.

From them, with the models ``draft_shape`` uses to choose shapes (engine overhead not included):
- the shape each shipped head's ``acceptance.json`` chooses, and its modelled speed-up;
- the *perfect-draft* bound: every draft token accepted, best chain length;
- a uniform head (acceptance alpha at every depth, top-1 only): the alpha each target speed-up
  needs, the best chain for it and its mean acceptance length tau.

    python benchmarks/heads_bound.py [--reps 15]

Writes benchmarks/results/heads_bound.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGETS = (1.0, 1.3, 1.6, 2.0)


def uniform(alpha: float, depth: int = 8):
    from verispec.draft_shape import AcceptanceProfile
    return AcceptanceProfile(tuple((alpha,) for _ in range(depth)), f"uniform alpha {alpha:.3f}")


def best_for(alpha: float, costs, max_depth: int):
    from verispec.draft_shape import best_tree
    return best_tree(uniform(alpha, max_depth), costs, max_depth=max_depth, max_width=1)


def alpha_needed(goal: float, costs, max_depth: int) -> float | None:
    """The least uniform acceptance whose best chain reaches ``goal`` (None: not even alpha 1)."""
    if best_for(1.0, costs, max_depth).speedup < goal:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if mid > 0 and best_for(mid, costs, max_depth).speedup >= goal:
            hi = mid
        else:
            lo = mid
    return hi


def measure(reps: int) -> dict:
    import torch

    from verispec.draft_shape import AcceptanceProfile, StepCosts, best_tree, measure_verify
    from verispec.drafters.eagle import draft_costs
    from verispec.drafters.eagle_head import HeadKind
    from verispec.drafters.medusa import draft_cost
    from verispec.formats import load_eagle_head, load_medusa_heads
    from verispec.models.loading import load_model
    torch.set_num_threads(2)
    target = load_model("smollm2-135m", weights="fp16")
    e3_dir, md_dir = ROOT / "checkpoints" / "smollm2-135m-eagle3", ROOT / "checkpoints" / "smollm2-135m-medusa"
    head = load_eagle_head(str(e3_dir), target.model, HeadKind.EAGLE3)
    head.pack_fp16_(target.model.lm_head)
    medusa = load_medusa_heads(str(md_dir), target.model)
    medusa.pack_fp16_(target.model.lm_head)
    verify = measure_verify(target.model, hidden_layers=head.hidden_layers, reps=reps)
    fixed, levels = draft_costs(head, reps=reps)
    e3 = StepCosts(verify, fixed, levels)
    md = StepCosts(verify, draft_cost(medusa, reps=reps))
    out = {"verify_ms": verify, "eagle3": {"draft_fixed_ms": fixed, "level_ms": levels},
           "medusa": {"draft_ms": md.draft_fixed}, "heads": {}}
    for name, folder, costs, depth in (("eagle3", e3_dir, e3, 8), ("medusa", md_dir, md, medusa.cfg.num_heads)):
        prof = AcceptanceProfile.load(folder)
        shipped = best_tree(prof, costs, max_depth=depth).as_dict()
        perfect = [{"chain": k, "speedup": (k + 1) * costs.vanilla_ms / _chain_ms(costs, k)}
                   for k in range(1, depth + 1)]
        need = {}
        for goal in TARGETS:
            a = alpha_needed(goal, costs, depth)
            if a is None:
                need[str(goal)] = None
                continue
            ch = best_for(a, costs, depth)
            need[str(goal)] = {"alpha": a, "chain": len(ch.choices), "tau": ch.expected_tokens}
        out["heads"][name] = {"profile_top1": [row[0] for row in prof.rank_probs], "shipped_choice": shipped,
                              "perfect_draft": perfect, "uniform_alpha_needed": need}
    return out


def _chain_ms(costs, k: int) -> float:
    from verispec.draft_shape import tree_cost
    return tree_cost(tuple(tuple([0] * i) for i in range(1, k + 1)), costs)


def report(res: dict, machine: str) -> str:
    v = dict(res["verify_ms"])
    lines = ["# What bounds the shipped heads on this machine", "",
             f"Machine: {machine}. SmolLM2-135M fp16-packed, 2 threads, batch 1, 256-token context; "
             f"fastest of {res['reps']} timings, all measured in this run ({res['date']}). Modelled with "
             "`draft_shape` (what the default configs use to choose their shapes); the engine's own "
             "per-step overhead and the prefill are not in these numbers, so real speed-ups are lower.", "",
             "## Measured costs", "",
             "| T | " + " | ".join(str(t) for t in v) + " |", "|---|" + "---|" * len(v),
             "| verify ms | " + " | ".join(f"{x:.1f}" for x in v.values()) + " |",
             "| / V(1) | " + " | ".join(f"{x / v[1]:.2f}" for x in v.values()) + " |", "",
             f"EAGLE-3 head: fixed draft cost (catch-up, ranks depth 1) {res['eagle3']['draft_fixed_ms']:.2f} ms; "
             "one more level over w nodes: " + ", ".join(f"w={w}: {ms:.2f} ms" for w, ms in res['eagle3']['level_ms'])
             + f". Medusa heads (every depth in one forward): {res['medusa']['draft_ms']:.2f} ms.", ""]
    for name, h in res["heads"].items():
        c = h["shipped_choice"]
        lines += [f"## {name}", "",
                  f"Shipped profile, top-1 acceptance by depth: " + ", ".join(f"{p:.2f}" for p in h["profile_top1"][:7]) + ".",
                  f"Its chosen shape: {c['num_nodes']} node(s), depth {c['depth']}, topk {c['topk']}: modelled "
                  f"{c['expected_tokens']:.2f} tokens per {c['step_ms']:.1f} ms step, **{c['modelled_speedup']:.2f}x**.", "",
                  "Perfect draft (every token accepted), chain of k: " +
                  ", ".join(f"k={p['chain']}: {p['speedup']:.2f}x" for p in h["perfect_draft"]) + ".", "",
                  "| speed-up goal | uniform top-1 acceptance needed | best chain | tau |", "|---|---|---|---|"]
        for goal, n in h["uniform_alpha_needed"].items():
            lines.append(f"| {float(goal):.1f}x | " + ("out of reach (above the perfect-draft bound) | | |" if n is None else
                         f"{n['alpha']:.3f} | {n['chain']} | {n['tau']:.2f} |"))
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=str(HERE / "results" / "heads_bound"))
    a = ap.parse_args()
    res = measure(a.reps)
    res |= {"reps": a.reps, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    from machine import machine_line          # benchmarks/ (this script's folder)
    machine = machine_line()
    res["machine"] = machine
    Path(a.out + ".json").write_text(json.dumps(res, indent=1))
    md = report(res, machine)
    Path(a.out + ".md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
