"""What bounds a model's shipped heads on this machine: measured step costs, and the
acceptance a head would need for a given speed-up.

One process, the target on ``--weights`` (default: SmolLM2-135M fp16-packed), 2 threads, measured
as the default configs measure at start-up (``draft_shape``'s own timers, fastest of ``--reps``):
- V(T): the target's verify forward over T tokens after a 256-token context, through the compiled
  forward the engines run (with the EAGLE-3 head's feature layers requested, as in decoding);
- the EAGLE-3 head's fixed draft cost (catch-up on one accepted token, which also ranks depth 1)
  and the cost of one more level over w nodes, and the Medusa heads' one forward, each timed after
  a target forward (cold caches, as in an engine step), with the heads' shipped vocabulary cuts.

From them, with the models ``draft_shape`` uses to choose shapes (engine overhead not included):
- the shape each shipped head's ``acceptance.json`` chooses, and its modelled speed-up;
- the *perfect-draft* bound: every draft token accepted, best chain length;
- a uniform head (acceptance alpha at every depth, top-1 only): the alpha each target speed-up
  needs, the best chain for it and its mean acceptance length tau.

And the bound no head can lift: the share of vanilla decoding's wall time spent in prefill on the
Spec-Bench benchmark's prompts (2 per category, 128 new tokens, compiled vanilla engine): a
speed-up over vanilla counts the prefill, which speculation does not shorten.

    python benchmarks/heads_bound.py [--reps 15]
    python benchmarks/heads_bound.py --model qwen2.5-coder-1.5b --weights int4-a8 --heads eagle3 \
        --out benchmarks/results/heads_bound_qwen2.5-coder-1.5b

Writes benchmarks/results/heads_bound.{json,md} (SmolLM2's) unless ``--out`` says otherwise.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from verispec.bench import harness

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGETS = (1.0, 1.3, 1.6, 2.0)


def uniform(alpha: float, depth: int = 8):
    from verispec.drafting.draft_shape import AcceptanceProfile
    return AcceptanceProfile(tuple((alpha,) for _ in range(depth)), f"uniform alpha {alpha:.3f}")


def best_for(alpha: float, costs, max_depth: int):
    from verispec.drafting.draft_shape import best_tree
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


def measure(reps: int, model: str = "smollm2-135m", weights: str = "fp16",
            heads: tuple[str, ...] = ("eagle3", "medusa")) -> dict:
    import torch

    from verispec.drafting.draft_shape import AcceptanceProfile, StepCosts, best_tree, measure_verify
    from verispec.drafting.eagle import draft_costs
    from verispec.drafting.eagle_head import HeadKind
    from verispec.drafting.medusa import draft_cost
    from verispec.formats import load_eagle_head, load_medusa_heads
    from verispec.models.loading import load_model
    from verispec.drafting.draft_shape import target_step
    from verispec.drafting.draft_vocab import FOLDER_FILE, load_draft_vocab
    from verispec.models.compiled import CompiledForward
    torch.set_num_threads(2)
    from verispec.models.draft_packing import draft_packing
    target = load_model(model, weights=weights)
    forward = CompiledForward.shared(target.model)
    forward.speculative = True
    e3_dir, md_dir = ROOT / "checkpoints" / f"{model}-eagle3", ROOT / "checkpoints" / f"{model}-medusa"
    head = load_eagle_head(str(e3_dir), target.model, HeadKind.EAGLE3)
    medusa = load_medusa_heads(str(md_dir), target.model) if "medusa" in heads else None
    for h, folder in ((head, e3_dir), (medusa, md_dir)):         # the shipped cuts, as the factories apply them
        if h is None:
            continue
        if (folder / FOLDER_FILE).is_file():
            h.restrict_vocab_(load_draft_vocab(folder / FOLDER_FILE, target.config.vocab_size).draft_ids)
        h.pack_(draft_packing(target, h) or "fp16", target.model.lm_head)    # as beside these weights
    verify = measure_verify(target.model, hidden_layers=head.hidden_layers, reps=reps, forward=forward)
    between = target_step(target.model, forward)
    fixed, levels, _ = draft_costs(head, reps=reps, between=between)
    e3 = StepCosts(verify, fixed, levels)
    out = {"model": model, "weights": weights, "verify_ms": verify,
           "eagle3": {"draft_fixed_ms": fixed, "level_ms": levels, "draft_vocab": head.lm_head.out_features},
           "heads": {}, "prefill": prefill_share(target)}
    todo = [("eagle3", e3_dir, e3, 8)]
    if medusa is not None:
        md = StepCosts(verify, draft_cost(medusa, reps=reps, between=between))
        out["medusa"] = {"draft_ms": md.draft_fixed,
                         "draft_vocab": int(medusa.vocab_ids.numel()) if medusa.vocab_ids is not None else None}
        todo.append(("medusa", md_dir, md, medusa.cfg.num_heads))
    for name, folder, costs, depth in todo:
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


def prefill_share(target, max_tokens: int = 128) -> dict:
    """Vanilla decoding (compiled) of the Spec-Bench questions, 2 per category: wall time of the
    prefill and of the decode steps, per category and overall."""
    import torch

    from verispec import LLM, SamplingParams
    from verispec.data import per_category, spec_bench_questions
    tok = target.tokenizer
    llm = LLM(loaded=target, compile=True)
    rows = []
    qs = per_category(spec_bench_questions(), 2)
    for i, q in enumerate([qs[0]] + qs):                  # the first one again: warm-up, not counted
        ids = tok(tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                          add_generation_prompt=True), add_special_tokens=False).input_ids
        seq = llm.new_sequence(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))[0]
        engine = llm.make_engine(1, len(ids) + max_tokens + 8)
        with torch.no_grad():
            t0 = time.perf_counter()
            engine.add_many([seq])
            t1 = time.perf_counter()
            while engine.num_running:
                engine.step()
            t2 = time.perf_counter()
        if i:
            rows.append({"category": q["category"], "prompt_tokens": len(ids), "prefill_s": t1 - t0, "decode_s": t2 - t1})
    cats: dict[str, list[dict]] = {}
    for r in rows:
        cats.setdefault(r["category"], []).append(r)
    share = lambda rs: sum(r["prefill_s"] for r in rs) / sum(r["prefill_s"] + r["decode_s"] for r in rs)  # noqa: E731
    return {"max_tokens": max_tokens, "overall": share(rows), "per_category": {c: share(rs) for c, rs in cats.items()},
            "mean_prompt_tokens": sum(r["prompt_tokens"] for r in rows) / len(rows), "rows": rows}


def _chain_ms(costs, k: int) -> float:
    from verispec.drafting.draft_shape import tree_cost
    return tree_cost(tuple(tuple([0] * i) for i in range(1, k + 1)), costs)


def report(res: dict) -> str:
    v = dict(res["verify_ms"])
    lines = [f"{res.get('model', 'smollm2-135m')} {res.get('weights', 'fp16')}, compiled, 2 threads, batch 1, "
             "256-token context; "
             f"fastest of {res['reps']} timings, all measured in this run. Modelled with "
             "`draft_shape` (what the default configs use to choose their shapes); the engine's own "
             "per-step overhead and the prefill are not in these numbers, so real speed-ups are lower (the "
             "prefill's share is measured below).", "",
             "## Measured costs", "",
             "| T | " + " | ".join(str(t) for t in v) + " |", "|---|" + "---|" * len(v),
             "| verify ms | " + " | ".join(f"{x:.1f}" for x in v.values()) + " |",
             "| / V(1) | " + " | ".join(f"{x / v[1]:.2f}" for x in v.values()) + " |", "",
             f"EAGLE-3 head ({res['eagle3'].get('draft_vocab', '16384')}-token draft vocabulary): fixed draft cost "
             f"(catch-up, ranks depth 1) {res['eagle3']['draft_fixed_ms']:.2f} ms; "
             "one more level over w nodes: " + ", ".join(f"w={w}: {ms:.2f} ms" for w, ms in res['eagle3']['level_ms'])
             + "." + (f" Medusa heads (every depth in one forward, {res['medusa'].get('draft_vocab') or 'full'}-token "
                      f"vocabulary): {res['medusa']['draft_ms']:.2f} ms." if "medusa" in res else "")
             + " Draft costs are timed after a target forward.", ""]
    pf = res.get("prefill")
    if pf:
        top = sorted(pf["per_category"].items(), key=lambda kv: -kv[1])
        lines += ["## Prefill: what no head shortens", "",
                  f"Compiled vanilla decoding of the 26 Spec-Bench questions (2 per category, {pf['max_tokens']} new "
                  f"tokens, mean prompt {pf['mean_prompt_tokens']:.0f} tokens) spends **{100 * pf['overall']:.0f}%** of "
                  f"its wall time in prefill (per category: " + ", ".join(f"{c} {100 * x:.0f}%" for c, x in top) + "). "
                  f"Even a free, always-right draft leaves that time, so the speed-up over vanilla on this benchmark "
                  f"is at most {1 / pf['overall']:.2f}x; a decode part f times faster gives 1 / (p + (1 - p) / f): "
                  + ", ".join(f"{f}x -> {1 / (pf['overall'] + (1 - pf['overall']) / f):.2f}x" for f in (1.2, 1.6, 2.0, 3.0))
                  + ".", ""]
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


OUT = harness.Output("heads_bound", "What bounds the shipped heads on this machine", report)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--model", default="smollm2-135m", help="the target; its heads are checkpoints/<model>-<method>")
    ap.add_argument("--weights", default="fp16", help="the target's weights (the heads are packed to match)")
    ap.add_argument("--heads", default="eagle3,medusa", help="eagle3 and optionally medusa")
    OUT.main(ap, run)


def run(a) -> dict:
    import torch
    torch.set_num_threads(2)
    machine = harness.machine_record()                  # before measuring, with its thread count
    return {"machine": machine, **measure(a.reps, a.model, a.weights, tuple(a.heads.split(","))), "reps": a.reps}


if __name__ == "__main__":
    main()
