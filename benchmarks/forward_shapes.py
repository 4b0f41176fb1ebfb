"""CPU cost of one target forward before and after bucketed shapes (issue #18 item 3).

On SmolLM2-135M with fp16-packed weights (``load_model("smollm2-135m", weights="fp16")``), batch 1
(``--batch``) at ``--context`` committed tokens, times one forward of T = 1 (decode) and T = 5 (a
chain verify, tree mask given) in four variants, interleaved rep by rep, the order rotated
(A B C D, B C D A, ...):
- ``before``: the forward of git ref ``--baseline`` (default ``main``), loaded from that ref's
  ``models/`` files into a scratch package and run over the *same* weights (modules re-classed,
  tensors shared) with that ref's ``KVCache``;
- ``after``: this tree's forward as the engine calls it today (no ``kv_len``);
- ``host_exact``: ``kv_len = cache.kv_len(rows, T, granule=1)``: today's shapes, no sync;
- ``bucketed``: this tree's forward with ``kv_len = cache.kv_len(rows, T)`` (multiples of 64).
The forwards write scratch slots only (lengths never change), so every rep sees the same state.
Reports median and quartiles per variant and the machine load before and after.

    OMP_NUM_THREADS=1 python benchmarks/forward_shapes.py [--reps 300] [--threads 1]
Writes benchmarks/results/forward_shapes.{json,md}.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from verispec.bench import harness

MODULES = ("config", "kv_cache", "packed", "transformer")


def load_baseline(ref: str):
    """(transformer module, kv_cache module) of git ``ref``, imported as package ``_baseline_models``."""
    repo = Path(__file__).resolve().parent.parent
    pkg = Path(tempfile.mkdtemp()) / "_baseline_models"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in MODULES:
        src = subprocess.run(["git", "show", f"{ref}:src/verispec/models/{name}.py"], cwd=repo,
                             check=True, capture_output=True, text=True).stdout
        (pkg / f"{name}.py").write_text(src)
    sys.path.insert(0, str(pkg.parent))
    return importlib.import_module("_baseline_models.transformer"), importlib.import_module("_baseline_models.kv_cache")


def reclass(mod: torch.nn.Module, classes: dict[str, type]) -> torch.nn.Module:
    """A shallow clone of ``mod``'s module tree whose transformer classes are ``classes[name]``
    (parameters, buffers and packed weights shared, nothing copied)."""
    own = type(mod).__module__ == "verispec.models.transformer"
    new = object.__new__(classes[type(mod).__name__] if own else type(mod))
    new.__dict__ = dict(mod.__dict__)
    new._modules = {k: reclass(v, classes) for k, v in mod._modules.items()}
    return new


def prefill(model, cache, context: int, batch: int) -> None:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, context), generator=g)
    with torch.no_grad():
        model(tokens, torch.arange(context).expand(batch, context), cache)
    cache.advance(torch.arange(batch), context)


def measure(args) -> dict:
    from verispec.models.kv_cache import KVCache
    from verispec.models.loading import load_model
    target = load_model("smollm2-135m", weights="fp16").model
    old_tf, old_kv = load_baseline(args.baseline)
    classes = {n: getattr(old_tf, n) for n in ("Transformer", "Block", "Attention", "MLP", "RMSNorm")}
    variants = {"before": (reclass(target, classes), old_kv.KVCache, {}),
                "after": (target, KVCache, {}), "host_exact": (target, KVCache, {"granule": 1}),
                "bucketed": (target, KVCache, {"granule": 64})}
    b, rows = args.batch, torch.arange(args.batch)
    out = {}
    for t in (1, 5):
        mask = torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t)
        tokens = torch.randint(0, target.cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(t))
        positions = (args.context + torch.arange(t)).expand(b, t)
        calls = {}
        for name, (model, cache_cls, opt) in variants.items():
            cache = cache_cls.for_model(target.cfg, b, args.context + 64)
            prefill(model, cache, args.context, b)
            kw = {"kv_len": cache.kv_len(range(b), t, opt["granule"])} if opt else {}
            calls[name] = (lambda m=model, c=cache, kw=kw:
                           m(tokens, positions, c, attn_mask=mask, rows=rows, **kw))
        with torch.no_grad():
            harness.interleave(calls, args.warmup)
            times = harness.interleave(calls, args.reps, rotate=True)      # the order rotated per rep
        out[f"T={t}"] = {name: summary(ts, times["before"]) for name, ts in times.items()}
    return out


def summary(ts: list[float], before: list[float]) -> dict:
    """Median and quartiles (ms), and the median of the per-rep ratios to ``before`` (the reps are
    interleaved, so each ratio compares calls made under the same machine load)."""
    q = statistics.quantiles(ts, n=4)
    return {"median_ms": 1e3 * statistics.median(ts), "q1_ms": 1e3 * q[0], "q3_ms": 1e3 * q[2], "reps": len(ts),
            "paired_ratio": statistics.median(a / b for a, b in zip(ts, before))}


def render(results: dict) -> str:
    lines = [f"SmolLM2-135M fp16-packed, batch {results['batch']}, {results['context']} committed tokens, "
             f"{results['machine']['threads']} torch thread(s), {results['reps']} interleaved reps per variant; "
             f"baseline = git `{results['baseline']}`. Load average {results['load_avg_at_end']:.2f} at the end.",
             "",
             "| T | variant | median ms | q1 | q3 | median / before's | paired ratio |",
             "|---|---|---|---|---|---|---|"]
    for t, row in results["times"].items():
        base = row["before"]["median_ms"]
        for name, s in row.items():
            lines.append(f"| {t[2:]} | {name} | {s['median_ms']:.3f} | {s['q1_ms']:.3f} | {s['q3_ms']:.3f} "
                         f"| {s['median_ms'] / base:.3f} | {s['paired_ratio']:.3f} |")
    lines += ["", "`after`: no `kv_len` (today's call); `host_exact`: `kv_len=cache.kv_len(rows, T, "
              "granule=1)` (today's shapes from the host mirror); `bucketed`: `kv_len=cache.kv_len(rows, T)` "
              "(multiples of 64: up to 63 more masked key slots per forward). Paired ratio: the median "
              "over reps of (this variant's time / `before`'s time in the same rep)."]
    return "\n".join(lines)


OUT = harness.Output("forward_shapes", "Target forward on the CPU: before / after bucketed shapes", render)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--baseline", default="main")
    args = OUT.parse(ap)
    if args is None:
        return
    torch.set_num_threads(args.threads)
    info = harness.machine_record()
    times = measure(args)
    results = {"machine": info, "batch": args.batch, "context": args.context, "reps": args.reps,
               "baseline": args.baseline, "times": times,
               "load_avg_at_end": os.getloadavg()[0]}
    print(OUT.write(results, args.out).read_text())


if __name__ == "__main__":
    main()
