"""CPU cost of committing a verify step's accepted K/V: ``KVCache.compact`` row by row (what the
engine calls today) vs one ``compact_batch`` for the batch.

A SmolLM2-135M-shaped cache (30 layers, 3 KV heads of 64, fp32, 1024 slots, rows at 300 tokens),
batch B in (1, 4, 8), six scratch slots per row, two accepted paths: a tree path (entries 0, 1,
3, 4: slots move) and a chain prefix (0, 1, 2, 3: nothing moves, both skip the copy on a CPU).
Each timed call is followed by a rollback to 300 (included); the variants alternate rep by rep.

    OMP_NUM_THREADS=1 python benchmarks/compact_batch_cost.py [--reps 300]
Writes benchmarks/results/compact_batch_cost.{json,md}.
"""
from __future__ import annotations

import argparse

import torch

from verispec.bench import harness

PATHS = {"tree": [0, 1, 3, 4], "chain": [0, 1, 2, 3]}
WIDTH, START = 6, 300


def measure(b: int, path: list[int], reps: int) -> dict:
    from verispec.models.kv_cache import KVCache
    cache = KVCache(30, b, 3, 1024, 64)
    cache.advance(range(b), [START] * b)
    keep = torch.tensor([path + [0] * (WIDTH - len(path))] * b)

    def per_row():
        for r in range(b):
            cache.compact(r, torch.tensor(path))
        cache.rollback(range(b), [START] * b)

    def batch():
        cache.compact_batch(range(b), keep, [len(path)] * b)
        cache.rollback(range(b), [START] * b)
    fns = {"per_row": per_row, "batch": batch}
    harness.interleave(fns, 5)                        # warm-up
    return harness.medians(harness.interleave(fns, reps), 1e3)


def render(results: dict) -> str:
    lines = [f"SmolLM2-135M-shaped cache (30 layers, 3 KV heads of 64, fp32), median ms of {results['reps']} "
             "reps (a rollback included).", "",
             "| B | accepted path | compact per row ms | compact_batch ms |", "|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['B']} | {r['path']} | {r['per_row']:.3f} | {r['batch']:.3f} |")
    return "\n".join(lines)


OUT = harness.Output("compact_batch_cost", "Committing accepted K/V: `compact` per row vs `compact_batch`", render)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=300)
    args = OUT.parse(ap)
    if args is None:
        return
    torch.set_num_threads(1)
    info = harness.machine_record()
    rows = [{"B": b, "path": kind, **measure(b, path, args.reps)} for b in (1, 4, 8) for kind, path in PATHS.items()]
    print(OUT.write({"machine": info, "reps": args.reps, "rows": rows}, args.out).read_text())


if __name__ == "__main__":
    main()
