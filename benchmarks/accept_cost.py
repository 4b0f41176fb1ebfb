"""Acceptance alone, per step: the sequential per-row, per-node loop (the verifier verispec used
before batched acceptance, kept as ``tests/reference_accept.py``) against ``accept_batch``.

Real sizes: SmolLM2's vocabulary (49152), an EAGLE-2 dynamic tree of 60 nodes (topk 10 at the
root), the demo tree of 4 nodes and a chain of 5; batch 1 and 4; greedy and T=0.8 with sampled q.
The two are interleaved rep by rep; medians. The per-row loop includes what the engine did per row
around it (``TreeBatch``'s packing is included on the batched side).

    python benchmarks/accept_cost.py [--reps 30]  ->  benchmarks/results/accept_cost.{json,md}
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from verispec.bench import harness

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from reference_accept import reference_greedy, reference_sampled  # noqa: E402

from verispec.core.params import SamplingParams  # noqa: E402
from verispec.core.sampling import target_probs  # noqa: E402
from verispec.core.tree import DraftTree  # noqa: E402
from verispec.core.tree_batch import TreeBatch  # noqa: E402
from verispec.core.verify import accept_batch  # noqa: E402

V = 49152


def _tree(shape: str, g: torch.Generator, sampled: bool) -> DraftTree:
    if shape == "chain5":
        parents = [-1, 0, 1, 2, 3]
    elif shape == "demo4":
        parents = [-1, -1, 0, 0]
    else:                                   # dynamic60: 10 root children, then 5 levels of 10
        parents = [-1] * 10 + [(i % 10) + 10 * (i // 10) for i in range(50)]
    toks = torch.randint(0, V, (len(parents),), generator=g)
    q = None
    if sampled:
        q = torch.softmax(torch.randn(len(parents), V, generator=g), -1)
        toks = torch.multinomial(q, 1, generator=g)[:, 0]
    return DraftTree(toks, torch.tensor(parents), q)


def _sequential(trees, logits, params, gens):
    out = []
    for b, t in enumerate(trees):
        rows = logits[b, :len(t) + 1]
        if params[b].greedy:
            out.append(reference_greedy(t, rows))
        else:
            u = torch.rand(len(t) + 1, generator=gens[b])
            out.append(reference_sampled(t, target_probs(rows, params[b]), u))
    return out


def _batched(trees, logits, params, gens):
    batch = TreeBatch.pack(trees, [100] * len(trees), [0] * len(trees), vocab=V)
    return accept_batch(batch, logits, params, gens).to_host()


def measure(reps: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for shape in ("chain5", "demo4", "dynamic60"):
        for batch in (1, 4):
            for temp in (0.0, 0.8):
                trees = [_tree(shape, g, temp > 0) for _ in range(batch)]
                logits = torch.randn(batch, max(len(t) for t in trees) + 1, V, generator=g) * 3
                params = [SamplingParams(temperature=temp)] * batch

                def call(fn, trees=trees, logits=logits, params=params, batch=batch):
                    gens = iter([[torch.Generator().manual_seed(r * 10 + k) for k in range(batch)]
                                 for r in range(reps)])          # made before timing: round r's seeds
                    return lambda: fn(trees, logits, params, next(gens))
                times = harness.interleave({"sequential": call(_sequential), "batched": call(_batched)}, reps,
                                           alternate=True)
                med = harness.medians(times, 1e3)
                seq, bat = med["sequential"], med["batched"]
                rows.append({"tree": shape, "batch": batch, "temperature": temp, "sequential_ms": seq,
                             "batched_ms": bat, "ratio": seq / bat})
                print(rows[-1], flush=True)
    return rows


def render(res: dict) -> str:
    rows = res["rows"]
    lines = [f"V = {V}, {res['reps']} interleaved reps, median ms.", "",
             "| tree | batch | T | sequential ms | batched ms | speed-up |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['tree']} | {r['batch']} | {r['temperature']} | {r['sequential_ms']:.2f} | "
              f"{r['batched_ms']:.2f} | {r['ratio']:.2f}x |" for r in rows]
    return "\n".join(lines)


OUT = harness.Output("accept_cost", "Acceptance per step: sequential per-node loop vs batched", render)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    args = OUT.parse(ap)
    if args is None:
        return
    torch.set_num_threads(2)
    res = {"machine": harness.machine_record(), "reps": args.reps}
    res["rows"] = measure(args.reps)
    print(OUT.write(res, args.out).read_text())


if __name__ == "__main__":
    main()
