"""The matmul kernels this CPU offers for a decoder's weights, over the real shapes (#20 item 1).

All matmuls of one forward (every layer's fused q/k/v, o, fused gate/up and down, plus the LM
head) with random weights of the model's shapes, at T = 1 (decoding) and T = 2, 4, 8 (verify
sizes), 2 threads, one module per matrix (cycled, so no weight stays in cache between uses).
Kernels timed, in turns within each repetition (fastest repetition reported):
- ``fp32``: dense ``F.linear`` (MKL / oneDNN sgemm, all threads);
- ``fp16-packed``: verispec's ``PackedFP16Linear`` (FBGEMM fp16 weights, fp32 activations, over
  all threads through ``csrc/fp16_gemm.cpp`` where it builds);
- ``int8-w8a8``: verispec's ``PackedInt8Linear`` (``csrc/int8_gemm.cpp``: int8 weights, each
  token's activations quantised to uint8 on its own, exact int32 sums with AVX-512 VNNI or AVX2);
- ``int8-dynamic``: ``torch.ao`` dynamic quantisation (FBGEMM ``quantized::linear_dynamic``,
  per-channel int8 weights, activations quantised per call);
- ``int8-rowwise``: ``torch._int_mm`` (int8 x int8 -> int32, exact) on per-channel int8 weights
  and activations quantised per row (token) in the forward: a row's result never depends on the
  other rows, which FBGEMM's dynamic kernel (one activation scale per call) cannot promise;
- ``int8-weight-only``: ``aten._weight_int8pack_mm`` (int8 weights, one scale per row, bf16
  activations);
- ``int4-weight-only``: ``aten._weight_int4pack_mm_for_cpu`` (groups of 32, bf16 activations);
- ``int4-verispec``: verispec's ``PackedInt4Linear`` (``csrc/int4_gemm.cpp``: the same codes,
  bf16 activations, AVX-512 BF16 pair dot products or AVX2, fp32 sums; row-invariant);
- ``int4-a8-verispec``: the same op's W4A8 path (the same codes, each token's activations
  quantised to int8 per group of 32 columns, exact int32 dot products with AVX-512 VNNI or AVX2,
  as llama.cpp's Q4 x Q8 kernels; row-invariant);
- ``bf16``: dense bf16 weights and activations (oneDNN; native on CPUs with avx512_bf16).

    python benchmarks/weight_kernels.py [--model smollm2-135m|qwen1.5b|both] [--reps 5]
        [--kernels int4-verispec,int4-a8-verispec] [--rows 1,2,4,8,64,177]

Writes benchmarks/results/weight_kernels.{json,md}. The numbers are kernels only: the quality
cost of each format is a separate table.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from verispec.bench import harness

ROWS = (1, 2, 4, 8)
RATIO_ROWS = (4, 8, 64, 177)      # T whose time over T=1's the table shows, where measured
SHAPES = {   # (out, in) per matrix of one forward
    "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)],
    "qwen1.5b": [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)] * 28 + [(151936, 1536)],
}


class Fp32(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = w.contiguous()

    def forward(self, x):
        return F.linear(x, self.w)


class Bf16(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = w.bfloat16().contiguous()

    def forward(self, x):
        return F.linear(x.bfloat16(), self.w).float()


def fp16_packed(w):
    from verispec.models.packed import PackedFP16Linear
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    return PackedFP16Linear(lin, keep_weight=False)


def int8_dynamic(w):
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    return quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear: per_channel_dynamic_qconfig})


def int8_w8a8(w):
    """verispec's own W8A8 op (``models.int8``): per-token uint8 activations, exact int32 sums."""
    from verispec.models.int8 import PackedInt8Linear
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    return PackedInt8Linear(lin)


def int4_verispec(w, int8_activations: bool = False):
    """verispec's own int4 op (``models.int4``); raises where it cannot be built."""
    from verispec.models.int4 import PackedInt4Linear, kernel
    if kernel() is None:
        raise RuntimeError("verispec's int4 kernel is unavailable here")
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    return PackedInt4Linear(lin, keep_weight=False, int8_activations=int8_activations)


class Int8Rowwise(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        s = w.abs().amax(1).clamp_min(1e-8) / 127
        self.wt = torch.round(w / s[:, None]).to(torch.int8).t()      # [in, out] view of [out, in]
        self.sw = s

    def forward(self, x):
        sx = x.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127
        xq = torch.round(x / sx).to(torch.int8)
        return torch._int_mm(xq, self.wt).float() * (sx * self.sw)


class Int8WeightOnly(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        s = w.abs().amax(1).clamp_min(1e-8) / 127
        self.w, self.s = torch.round(w / s[:, None]).to(torch.int8), s.bfloat16()

    def forward(self, x):
        return torch.ops.aten._weight_int8pack_mm(x.bfloat16(), self.w, self.s).float()


class Int4WeightOnly(torch.nn.Module):
    def __init__(self, w, group: int = 32):
        super().__init__()
        n, k = w.shape
        g = w.reshape(n, k // group, group)
        lo, hi = g.amin(-1), g.amax(-1)
        sc = ((hi - lo) / 15).clamp(min=1e-8)
        q = torch.round((g - lo[..., None]) / sc[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
        self.sz = torch.stack([sc, lo + 8 * sc], -1).transpose(0, 1).contiguous().bfloat16()
        self.w, self.group = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), group

    def forward(self, x):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), self.w, self.group, self.sz).float()


KERNELS = {"fp32": Fp32, "fp16-packed": fp16_packed, "int8-w8a8": int8_w8a8, "int8-dynamic": int8_dynamic,
           "int8-rowwise": Int8Rowwise, "int8-weight-only": Int8WeightOnly, "int4-weight-only": Int4WeightOnly,
           "int4-verispec": int4_verispec, "int4-a8-verispec": lambda w: int4_verispec(w, True), "bf16": Bf16}


# Kernels that hold at most 2 bytes a weight once built (fp16-packed; int4 keeps its codes): timed
# in turns even on the 1.5B model when only they are asked for.
TURNS_ALWAYS = {"fp16-packed", "int4-verispec", "int4-a8-verispec"}


def measure(shapes, reps: int, kernels=tuple(KERNELS), rows=ROWS) -> dict:
    """ms of all matmuls of one forward, per kernel and T (fastest of ``reps``). Models whose
    weights fit several times in memory get every kernel built at once and timed in turns within
    each repetition; bigger ones (Qwen 1.5B: 5.9 GB in fp32) one kernel at a time, from the same
    seeded weights, so that no two copies of the model have to fit together."""
    fp32_bytes = sum(n * k for n, k in shapes) * 4
    together = fp32_bytes * 4 < 0.5 * _mem_bytes() or set(kernels) <= TURNS_ALWAYS
    groups = [list(kernels)] if together else [[name] for name in kernels]
    best, unavailable = {}, {}
    for names in groups:
        mods = {}
        for name in names:
            try:
                mods[name] = [KERNELS[name](w) for w in _weights(shapes)]
            except Exception as e:          # a kernel this build or CPU lacks: reported, not fatal
                unavailable[name] = f"{type(e).__name__}: {e}"[:200]
        best |= _time(mods, shapes, reps, rows)
        del mods
    return {"ms": best, "unavailable": unavailable, "weight_mb": fp32_bytes / 2**20, "rows": list(rows),
            "timed": "in turns" if together else "one kernel at a time (memory)"}


def _weights(shapes):
    g = torch.Generator().manual_seed(0)
    for n, k in shapes:
        yield torch.randn(n, k, generator=g) * 0.02


def _mem_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _time(mods: dict, shapes, reps: int, rows=ROWS) -> dict:
    xs = {t: {k: torch.randn(t, k) for _, k in shapes} for t in rows}

    def forward(ms, x):
        def call():
            for m, (_, k) in zip(ms, shapes):
                m(x[k])
        return call
    calls = {(name, t): forward(ms, xs[t]) for t in rows for name, ms in mods.items()}
    with torch.no_grad():
        times = harness.interleave(calls, reps + 1)          # every (T, kernel) once per round, in turns
    return {name: {t: 1e3 * min(times[name, t][1:]) for t in rows} for name in mods}   # round 0 warms up


def report(doc: dict) -> str:
    lines = [f"{doc['threads']} threads; random weights of the real shapes, fastest of {doc['reps']} repetitions "
             "with the kernels timed in turns. Kernels only (no attention, norms or other ops); quality is "
             "measured separately.", ""]
    for model, r in doc["results"].items():
        r = _int_keys(r)                                       # JSON made the T keys strings
        ms, rows = r["ms"], r.get("rows", list(ROWS))
        ratios = [t for t in rows[1:] if t in RATIO_ROWS]
        base_name = "fp16-packed" if "fp16-packed" in ms else next(iter(ms))
        base = ms[base_name]
        lines += [f"## {model} ({r['weight_mb']:.0f} MB of fp32 weights; kernels timed {r['timed']})", "",
                  "| kernel | " + " | ".join(f"T={t} ms" for t in rows) + f" | T=1 vs {base_name} | " +
                  " | ".join(f"T={t} / T=1" for t in ratios) + " |",
                  "|---|" + "---|" * (len(rows) + 1 + len(ratios))]
        for name, row in ms.items():
            lines.append(f"| {name} | " + " | ".join(f"{row[t]:.1f}" for t in rows) +
                         f" | {base[1] / row[1]:.2f}x | " + " | ".join(f"{row[t] / row[1]:.2f}" for t in ratios) + " |")
        for name, why in r["unavailable"].items():
            lines.append(f"| {name} | unavailable: {why} |")
        lines.append("")
    return "\n".join(lines)


def _int_keys(r: dict) -> dict:
    """An earlier run's rows as measured (JSON made the T keys strings)."""
    return r | {"ms": {k: {int(t): v for t, v in row.items()} for k, row in r["ms"].items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("smollm2-135m", "qwen1.5b", "both"), default="smollm2-135m")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the other models' rows of an earlier run")
    ap.add_argument("--kernels", default=",".join(KERNELS), help="which kernels (comma-separated; default all)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="token counts T (comma-separated; 1 first)")
    a = OUT.parse(ap)
    if a is None:
        return
    torch.set_num_threads(a.threads)
    machine = harness.machine_record()
    models = list(SHAPES) if a.model == "both" else [a.model]
    out = Path(a.out + ".json")
    res = {m: _int_keys(r) for m, r in json.loads(out.read_text())["results"].items()} if a.keep and out.exists() else {}
    for m in models:
        kernels = a.kernels.split(",")
        unknown = set(kernels) - set(KERNELS)
        if unknown:
            raise SystemExit(f"unknown kernels {sorted(unknown)}; known: {list(KERNELS)}")
        rows = tuple(int(t) for t in a.rows.split(","))
        if rows[0] != 1:
            raise SystemExit("--rows must start with 1 (the ratios are to T=1)")
        res[m] = measure(SHAPES[m], a.reps, kernels, rows)
        print(m, json.dumps({k: {t: round(v, 1) for t, v in d.items()} for k, d in res[m]["ms"].items()}), flush=True)
    print(OUT.write({"machine": machine, "reps": a.reps, "threads": a.threads, "results": res}, a.out).read_text())


OUT = harness.Output("weight_kernels", "Weight kernels on this CPU: all matmuls of one forward", report)


if __name__ == "__main__":
    main()
