"""What the suffix drafter costs per step outside the model: ``start`` on a 2000-token prompt,
then 200 steps of ``propose`` + ``accept`` (4 new tokens a step: 3 committed with the root, one
new root), on a repetitive context (a 400-token block repeated, the text goes on repeating it)
and on random tokens (nothing matches).

    python benchmarks/suffix_step_cost.py       # writes results/suffix_step_cost.{json,md}
"""
from __future__ import annotations

import argparse
import itertools
import random
import time

from verispec.bench import harness


def measure(repetitive: bool, steps: int = 200) -> dict:
    from verispec.drafting.base import DraftRequest
    from verispec.drafting.suffix import SuffixCache, SuffixDrafter
    from verispec.core.params import SamplingParams
    rnd = random.Random(0)
    base = [rnd.randrange(49152) for _ in range(400 if repetitive else 2000)]
    prompt = list(itertools.islice(itertools.cycle(base), 2000))
    drafter = SuffixDrafter(SuffixCache(24, 10000))
    t = time.perf_counter()
    drafter.start(0, prompt)
    start_s = time.perf_counter() - t
    # the "target" goes on with the repeated block (repetitive) or with random tokens, 4 per step
    stream = itertools.cycle(base) if repetitive else iter(lambda: rnd.randrange(49152), None)
    for _ in range(len(prompt) % len(base) if repetitive else 0):
        next(stream)
    ctx, times, nodes = prompt + [next(stream)], [], []
    sp = SamplingParams(temperature=0)
    for _ in range(steps):
        new = [next(stream) for _ in range(4)]
        t = time.perf_counter()
        tree = drafter.propose([DraftRequest(0, ctx, sp, None)])[0]
        drafter.accept(0, [ctx[-1]] + new[:3], None)
        times.append(time.perf_counter() - t)
        nodes.append(len(tree))
        ctx = ctx + new
    times.sort()
    return {"start_ms": 1e3 * start_s, "step_median_us": 1e6 * times[steps // 2],
            "step_p90_us": 1e6 * times[int(steps * 0.9)], "mean_tree_nodes": sum(nodes) / steps}


def render(res: dict) -> str:
    lines = ["| context (2000-token prompt) | start ms | propose+accept median us | p90 us | tree nodes |",
             "|---|---:|---:|---:|---:|"]
    for name, r in res["runs"].items():
        lines.append(f"| {name} | {r['start_ms']:.2f} | {r['step_median_us']:.1f} | {r['step_p90_us']:.1f} | "
                     f"{r['mean_tree_nodes']:.1f} |")
    return "\n".join(lines)


OUT = harness.Output("suffix_step_cost", "Suffix drafter: cost per step outside the model", render,
                     legacy_command=lambda res: "python benchmarks/suffix_step_cost.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    OUT.main(ap, lambda args: {"machine": harness.machine_record(),
                               "runs": {"repetitive": measure(True), "random (no match)": measure(False)}})


if __name__ == "__main__":
    main()
