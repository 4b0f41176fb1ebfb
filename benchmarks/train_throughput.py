"""EAGLE-3 training throughput with and without the offline feature cache (issue 22 item 3).

On the same regenerated conversations (``--data``, first ``--limit`` of each file): (1) ``verispec
data features`` writes the target's hidden states once (fp16 safetensors shards); (2) ``verispec
train eagle3`` runs ``--steps`` optimizer steps reading the target forward online; (3) the same
steps reading the cache (``--features``). Each runs in its own process with the same threads.
Reported: sequence tokens and loss tokens per second of training (from the run's own log, first
step left out as warm-up), the feature pass's tokens per second, and the epochs after which the
cache has paid for itself.

    python benchmarks/train_throughput.py --data runs/regen/a.jsonl runs/regen/b.jsonl
    python benchmarks/train_throughput.py --model qwen2.5-coder-1.5b --target-weights int4-a8 --head none \
        --draft-vocab-size 32768 --data runs/qwen/regen.jsonl --out benchmarks/results/train_throughput_qwen

``--head none`` trains a new head initialised from the target (``--head-init target``) instead of
warm-starting a shipped one; ``--target-weights`` is the target's weights while features are read.

Results: ``benchmarks/results/train_throughput.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from verispec.bench import harness

VERISPEC = [sys.executable, "-m", "verispec.cli"]


def _run(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def _rates(run: Path) -> dict:
    """Tokens per second over the logged steps after the first (warm-up)."""
    recs = [json.loads(ln) for ln in (run / "log.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "elapsed_s" in r and "loss" in r]
    first, last = steps[0], steps[-1]
    dt = last["elapsed_s"] - first["elapsed_s"]
    loss_tokens = sum(r["count"] for r in steps[1:])
    return {"steps_timed": len(steps) - 1, "seconds": dt, "loss_tokens_per_s": loss_tokens / dt,
            "seconds_per_step": dt / (len(steps) - 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", nargs="+", help="regenerated conversations (JSONL; required to measure)")
    ap.add_argument("--limit", type=int, default=48)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--head", default=HEAD, help="head to warm-start from, or 'none' (a new head from the target)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--target-weights", default="dense")
    ap.add_argument("--draft-vocab-size", type=int, default=None, help="a new head's draft vocabulary")
    ap.add_argument("--ttt-length", type=int, default=5)
    args = OUT.parse(ap, argv)
    if args is None:
        return 0
    if not args.data:
        ap.error("--data is required")
    machine = harness.machine_record()
    tmp = Path(tempfile.mkdtemp(prefix="verispec-tt-"))
    common = ["--model", args.model, "--data", *args.data, "--limit", str(args.limit), "--max-length", "512",
              "--heldout-fraction", "0.05", "--threads", str(args.threads), "--target-weights", args.target_weights]
    feats = tmp / "feats"
    t_feat = _run(VERISPEC + ["data", "features", *common, "--out", str(feats), "--dtype", "fp16", "--quiet"])
    index = json.loads((feats / "index.json").read_text())
    cache_bytes = sum(f.stat().st_size for f in feats.iterdir())
    if args.head != "none":
        start = ["--init-from", args.head]
    else:
        start = ["--head-init", "target"]
        if args.draft_vocab_size:
            start += ["--draft-vocab-size", str(args.draft_vocab_size)]
    train = ["train", "eagle3", *common, *start, "--ttt-length", str(args.ttt_length), "--batch-size", "4",
             "--micro-batch-size", "4", "--max-steps", str(args.steps), "--log-every", "1", "--save-every", "1000",
             "--dtype", "bf16", "--quiet"]
    rows = {}
    for name, extra in (("online", []), ("cache", ["--features", str(feats)])):
        run = tmp / name
        _run(VERISPEC + train + ["--out", str(run)] + extra)
        rows[name] = _rates(run)
    meta = json.loads((tmp / "online" / "train_meta.json").read_text())
    tokens = meta.get("train_tokens") or 0
    feat_rate = tokens / t_feat if t_feat else 0.0
    ratio = rows["cache"]["loss_tokens_per_s"] / rows["online"]["loss_tokens_per_s"]
    result = {"machine": machine, "threads": args.threads, "data": args.data, "limit": args.limit,
              "head": args.head, "steps": args.steps, "model": args.model, "target_weights": args.target_weights,
              "draft_vocab_size": args.draft_vocab_size, "ttt_length": args.ttt_length,
              "train_sequences": meta.get("train_sequences"), "train_tokens": tokens,
              "feature_pass_s": t_feat, "feature_pass_tokens_per_s": feat_rate, "feature_layers": index.get("layers"),
              "cache_bytes": cache_bytes, "cache_bytes_per_token": cache_bytes / max(tokens, 1),
              "online": rows["online"], "cache": rows["cache"], "speedup_with_cache": ratio}
    shutil.rmtree(tmp, ignore_errors=True)
    print(OUT.write(result, args.out).read_text())
    return 0


def render(r: dict) -> str:
    online, cache = r["online"], r["cache"]
    head = r.get("head", HEAD)
    start = (f"a new head initialised from the target (draft vocabulary {r.get('draft_vocab_size') or 'full'})"
             if head == "none" else f"head warm-started from `{head}`")
    return "\n".join([
        f"Target `{r.get('model', 'smollm2-135m')}` with `{r.get('target_weights', 'dense')}` weights. Training with "
        f"{r['threads']} thread(s); {start}; TTT {r.get('ttt_length', 5)}, bf16 "
        f"autocast, 4 sequences of at most 512 tokens per step; {r.get('steps', 6)} steps, the first left out.", "",
        "| run | seconds per step | loss tokens/s |", "|---|---|---|",
        f"| online (target forward in every step) | {online['seconds_per_step']:.2f} | "
        f"{online['loss_tokens_per_s']:.1f} |",
        f"| feature cache | {cache['seconds_per_step']:.2f} | {cache['loss_tokens_per_s']:.1f} |", "",
        f"Cache: {r['train_tokens']} sequence tokens written in {r['feature_pass_s']:.1f} s "
        f"({r['feature_pass_tokens_per_s']:.0f} tokens/s, process start and model load included), "
        f"{r['cache_bytes'] / 2**20:.1f} MiB ({r['cache_bytes_per_token']:.0f} bytes per token, fp16). Training "
        f"reads it {r['speedup_with_cache']:.2f}x as fast as it runs the target itself."])


HEAD = "checkpoints/smollm2-135m-eagle3"
OUT = harness.Output("train_throughput", "EAGLE-3 training throughput, with and without the feature cache", render,
                     legacy_command=lambda r: f"python benchmarks/train_throughput.py --data {' '.join(r['data'])} "
                                              f"--limit {r['limit']}")


if __name__ == "__main__":
    sys.exit(main())
