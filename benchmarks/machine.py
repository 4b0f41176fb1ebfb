"""Machine description written next to every benchmark result."""
from __future__ import annotations

import os
import platform

import torch


def machine_info() -> dict:
    from verispec.bench.runner import cpu_model
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version(),
            "load_avg_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def parse_result_args(ap, name: str, write_md) -> "object | None":
    """Add ``--out`` (default results/<name>) and ``--rerender`` to ``ap`` and parse. With
    ``--rerender`` rewrite the Markdown from the saved JSON and return None."""
    import argparse
    import json
    assert isinstance(ap, argparse.ArgumentParser)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", name))
    ap.add_argument("--rerender", action="store_true", help="rewrite the Markdown from the saved JSON")
    args = ap.parse_args()
    if not args.rerender:
        return args
    with open(args.out + ".json") as f:
        write_md(json.load(f), args.out + ".md")
    return None


def write_result(results: dict, out: str, write_md) -> None:
    """Write ``out``.json atomically, then ``write_md(results, out + ".md")``."""
    import json
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json.tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(out + ".json.tmp", out + ".json")
    write_md(results, out + ".md")


def machine_line(with_isa: bool = False) -> str:
    """One line for a result's header: CPU model (with its vector ISA if asked), cores and the
    load average when the run ends."""
    from verispec.bench.runner import cpu_model
    cpu = cpu_model()
    if with_isa:
        try:
            flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
        except OSError:
            flags = ""
        isa = "AVX-512 with bf16/VNNI" if "avx512_bf16" in flags else ("AVX-512" if "avx512f" in flags else "AVX2")
        cpu = f"{cpu} ({isa})"
    return f"{cpu}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at the end"


def run_per_model(ap, prefix: str, run, write_md) -> None:
    """``main`` of a benchmark with a ``--model`` option (added here, default smollm2-135m): results
    go to results/<prefix>_<model>.{json,md} unless ``--out`` says otherwise; ``run(args) -> dict``
    with a ``settings`` entry (``--out``/``--rerender`` are dropped from it)."""
    import argparse
    ap.add_argument("--model", default="smollm2-135m")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", default="smollm2-135m")
    model = pre.parse_known_args()[0].model
    args = parse_result_args(ap, f"{prefix}_{model.replace('/', '_')}", write_md)
    if args is None:
        return
    res = run(args)
    for k in ("out", "rerender"):
        res["settings"].pop(k, None)
    write_result(res, args.out, write_md)
    print("wrote", args.out + ".md")
