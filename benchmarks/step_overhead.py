"""Per-step time outside the draft and target forwards, before and after batched acceptance.

A step is propose + verify forward + the rest (acceptance, cache compaction, drafter hand-over,
emission). This script times all three from outside the engine (wrapping the target's forward
and the drafter's propose), so it runs unchanged on any verispec source tree: the driver runs a
worker subprocess per source tree (``--src DIR`` with ``PYTHONPATH=DIR``), interleaved round by
round, and reports medians per step of the "rest".

    python benchmarks/step_overhead.py --src /path/before/src --src src --label before --label after

Results: ``benchmarks/results/step_overhead.{json,md}``. Target: SmolLM2-135M, fp16-packed weights
unless ``--weights`` says otherwise, 2 threads. With ``--configs compiled`` the table also sets each
drafted step beside a plain one: what a step of each config costs over vanilla's, per tree.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

CONFIGS = [   # (name, speculative_config, temperature, batch)
    ("eagle3 dynamic tree (topk 8, depth 6), greedy", {"method": "eagle3", "topk": 8, "depth": 6}, 0.0, 1),
    ("eagle3 dynamic tree (topk 8, depth 6), T=0.8", {"method": "eagle3", "topk": 8, "depth": 6}, 0.8, 1),
    ("eagle3 demo tree (4 nodes), greedy, batch 4", {"method": "eagle3", "topk": 2, "depth": 3,
                                                     "num_draft_tokens": 4}, 0.0, 4),
    ("eagle3 demo tree (4 nodes), T=0.8, batch 4", {"method": "eagle3", "topk": 2, "depth": 3,
                                                    "num_draft_tokens": 4}, 0.8, 4),
    ("ngram chain of 5, greedy", {"method": "ngram", "num_speculative_tokens": 5}, 0.0, 1),
]
# ``--configs compiled``: what the default configs run on this CPU (compiled forwards, batch 1, greedy)
COMPILED = [
    ("vanilla, compiled", None, 0.0, 1),
    ("eagle3 chain of 1, compiled", {"method": "eagle3", "num_speculative_tokens": 1}, 0.0, 1),
    ("eagle3 chain of 2, compiled", {"method": "eagle3", "num_speculative_tokens": 2}, 0.0, 1),
    ("medusa 2 siblings, compiled", {"method": "medusa", "tree": [[0], [1]]}, 0.0, 1),
    ("suffix, compiled", {"method": "suffix"}, 0.0, 1),
]


def worker(max_tokens: int, prompts: int, configs: str = "eager", weights: str = "fp16") -> dict:
    """Time every step of each config on this process's verispec; print JSON."""
    import torch
    from verispec import LLM, SamplingParams
    from verispec.data import per_category, spec_bench_questions
    from verispec.models.loading import load_model
    torch.set_num_threads(2)
    target = load_model("smollm2-135m", weights=weights)
    tok = target.tokenizer
    qs = per_category(spec_bench_questions(), 1)[:prompts]
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                       add_generation_prompt=True), add_special_tokens=False).input_ids for q in qs]
    out = {}
    compiled = configs == "compiled"
    for name, spec, temp, batch in (COMPILED if compiled else CONFIGS):
        llm = LLM(loaded=target, speculative_config=spec, max_num_seqs=batch, **({"compile": True} if compiled else {}))
        rest, fwd, prop, tot = [], [], [], []
        for start in range(0, len(ids), batch):
            chunk = ids[start:start + batch]
            params = SamplingParams(temperature=temp, max_tokens=max_tokens, ignore_eos=True, seed=start)
            seqs = [llm.new_sequence(p, params)[0] for p in chunk]
            engine = llm.make_engine(len(seqs), max(len(p) for p in chunk) + max_tokens)
            engine.add_many(seqs)
            timer = _wrap(engine)
            if compiled:
                engine.step()                        # the first step (EAGLE: the prompt's catch-up) aside
            while engine.num_running:
                timer.reset()
                t0 = time.perf_counter()
                engine.step()
                total = time.perf_counter() - t0
                rest.append(total - timer.forward - timer.propose)
                fwd.append(timer.forward)
                prop.append(timer.propose)
                tot.append(total)
        out[name] = {"steps": len(rest), "rest_ms": 1e3 * statistics.median(rest), "step_ms": 1e3 * statistics.median(tot),
                     "forward_ms": 1e3 * statistics.median(fwd), "propose_ms": 1e3 * statistics.median(prop),
                     "rest_mean_ms": 1e3 * statistics.fmean(rest)}
    return out


class _Timer:
    def __init__(self):
        self.reset()

    def reset(self):
        self.forward = self.propose = 0.0


def _wrap(engine) -> _Timer:
    """Time the target forward (the engine's model call) and the drafter's propose."""
    timer = _Timer()
    model, drafter = engine.model, engine.drafter

    def timed(fn, attr):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                setattr(timer, attr, getattr(timer, attr) + time.perf_counter() - t0)
        return call
    if hasattr(engine, "_forward"):      # the call the engine makes (a compiled forward, or the model)
        engine._forward = timed(engine._forward, "forward")
    else:
        model.forward = timed(type(model).forward.__get__(model), "forward")
    if drafter is not None:
        drafter.propose = timed(type(drafter).propose.__get__(drafter), "propose")
    return timer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--configs", choices=("eager", "compiled"), default="eager",
                    help="eager: the 2026-12-03 set (eager forwards, trees, batch 4); compiled: batch-1 greedy "
                         "steps on compiled forwards, the default configs' shapes")
    ap.add_argument("--weights", default="fp16", help="the target's weights (fp16: the 2026-12-03 runs; int4: the "
                                                      "fast path)")
    if "--worker" in sys.argv[1:]:        # one tree's worker: that tree's verispec may predate bench.harness
        ap.add_argument("--worker", action="store_true")
        a = ap.parse_args()
        print(json.dumps(worker(a.max_tokens, a.prompts, a.configs, a.weights)))   # to the driver's pipe
        return
    from verispec.bench import harness
    harness.add_tree_options(ap, rounds=3)
    out = harness.Output("step_overhead", TITLE, render)
    a = out.parse(ap)
    if a is None:
        return
    machine = harness.machine_record()
    runs = harness.run_trees(__file__, a.src, a.label, a.rounds, ["--max-tokens", str(a.max_tokens), "--prompts",
                                                                 str(a.prompts), "--configs", a.configs,
                                                                 "--weights", a.weights],
                             env={"OMP_WAIT_POLICY": "PASSIVE"})
    labels, names = list(runs), list(runs[a.label[0]][0])
    med = {lab: {n: {k: statistics.median(run[n][k] for run in runs[lab]) for k in runs[lab][0][n]}
                 for n in names} for lab in labels}
    res = {"machine": machine, "rounds": a.rounds, "max_tokens": a.max_tokens, "prompts": a.prompts,
           "weights": a.weights, "runs": runs, "median": med}
    print(out.write(res, a.out).read_text())


def render(res: dict) -> str:
    med = res["median"]
    labels = list(med)
    names = list(med[labels[0]])
    weights = {"fp16": "fp16-packed"}.get(res.get("weights", "fp16"), res.get("weights"))
    lines = [f"SmolLM2-135M {weights}, 2 threads, {res['prompts']} Spec-Bench prompts, "
             f"{res['max_tokens']} tokens, median over steps, then over {res['rounds']} interleaved rounds.", "",
             "| config | " + " | ".join(f"{lab}: rest ms/step" for lab in labels) + " | ratio | forward ms | propose ms |"
             " step ms | rest share |",
             "|---|" + "---|" * (len(labels) + 5)]
    for n in names:
        rest = [med[lab][n]["rest_ms"] for lab in labels]
        last = med[labels[-1]][n]
        step = last.get("step_ms")
        share = f"{100 * rest[-1] / step:.1f}%" if step else "–"
        lines.append(f"| {n} | " + " | ".join(f"{x:.2f}" for x in rest) +
                     f" | {rest[0] / rest[-1]:.2f}x | {last['forward_ms']:.1f} | "
                     f"{last['propose_ms']:.2f} | {f'{step:.2f}' if step else '–'} | {share} |")
    plain = next((n for n in names if n.startswith("vanilla")), None)
    if plain is not None and all("step_ms" in med[lab][plain] for lab in labels):
        lines += ["", "A step of each config over a plain (vanilla) step of the same tree, in ms: its step, and "
                      "the parts (propose, verify forward, rest) of the difference.", "",
                  "| config | " + " | ".join(f"{lab}: over vanilla (propose + forward + rest)" for lab in labels) + " |",
                  "|---|" + "---|" * len(labels)]
        for n in names:
            if n == plain:
                continue
            cells = []
            for lab in labels:
                m, v = med[lab][n], med[lab][plain]
                cells.append(f"{m['step_ms'] - v['step_ms']:+.2f} ({m['propose_ms'] - v['propose_ms']:+.2f} "
                             f"{m['forward_ms'] - v['forward_ms']:+.2f} {m['rest_ms'] - v['rest_ms']:+.2f})")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


TITLE = "Step overhead: time per step outside the draft and target forwards"


if __name__ == "__main__":
    main()
