"""``verispec export``: write a trained head folder in the layout EAGLE, SGLang, vLLM or Medusa loads."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..formats import CheckpointError
from ..train.export import VALID_FORMATS, ExportFormat, detect_source, export


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _source_dtype(src: Path) -> str:
    """The head's dtype (config ``torch_dtype`` or the first stored tensor), to load the target in."""
    try:
        cfg = json.loads((src / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        cfg = {}
    if cfg.get("torch_dtype") in ("float32", "float16", "bfloat16"):
        return cfg["torch_dtype"]
    for f in sorted(src.glob("*.safetensors")):
        try:
            from safetensors import safe_open
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():
                    dt = h.get_slice(name).get_dtype()
                    if dt in ("BF16", "F16", "F32"):
                        return {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}[dt]
        except Exception:  # noqa: BLE001 - unreadable files are reported by the export itself
            break
    return "float32"


def _load_target(name: str, dtype: str):
    """The target ``Transformer`` (``--target``: a known model name, GGUF file or HF folder)."""
    from ..models.loading import load_model
    return load_model(name, dtype=dtype, with_tokenizer=False).model


def cmd_export(args: argparse.Namespace) -> int:
    src, dst = Path(args.src), Path(args.dst)
    target = None
    try:
        kind = detect_source(src)
        if args.format not in {f.value for f in VALID_FORMATS[kind]}:
            valid = ", ".join(f.value for f in VALID_FORMATS[kind])
            raise CheckpointError(f"format {args.format!r} does not fit a {kind.value} source; valid formats: {valid}")
        if args.target:
            dtype = _source_dtype(src)
            print(f"loading target {args.target} ({dtype}) ...", file=sys.stderr)
            target = _load_target(args.target, dtype)
        report = export(src, dst, args.format, target, overwrite=args.overwrite,
                        base_model_name_or_path=args.base_model)
    except CheckpointError as e:
        print(f"verispec export: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - a target that will not load is a user error, not a crash
        if target is None and args.target:
            print(f"verispec export: cannot load target {args.target!r}: {e}", file=sys.stderr)
            return 1
        raise
    print(f"exported {report.source.value} -> {report.format.value}: {report.path}")
    width = max(len(name) for name, _ in report.files)
    for name, n in report.files:
        extra = f"  ({report.tensors} tensors)" if name != "config.json" else ""
        print(f"  {name.ljust(width)}  {_size(n):>10}{extra}")
    print(f"  {'total'.ljust(width)}  {_size(report.total_bytes):>10}")
    for note in report.notes:
        print(f"note: {note}")
    return 0


def add_parser(subparsers) -> None:
    """Add ``export SRC DST --format ...`` to an argparse ``subparsers`` object."""
    p = subparsers.add_parser(
        "export", help="write a trained EAGLE / Medusa head for the EAGLE repo, SGLang, vLLM or Medusa",
        description="Convert a head folder saved by verispec (EAGLE-3, EAGLE-1 or Medusa heads) into the "
                    "layout another stack loads: eagle (SafeAILab/EAGLE EaModel), sglang, vllm, medusa "
                    "(FasterDecoding). Tensors keep their dtype; formats that cannot express the head are "
                    "refused with the reason.")
    p.add_argument("src", metavar="SRC", help="head folder (config.json + weights)")
    p.add_argument("dst", metavar="DST", help="output folder (must be empty unless --overwrite)")
    p.add_argument("--format", required=True, choices=[f.value for f in ExportFormat],
                   help="eagle3/eagle1 heads: eagle, sglang, vllm; Medusa heads: medusa, vllm")
    p.add_argument("--target", metavar="MODEL", default=None,
                   help="target model (known name, GGUF file or HF folder); needed for tied Medusa heads, to "
                        "check own embeddings, and to include the embedding in the eagle format")
    p.add_argument("--base-model", metavar="HF_ID", default=None,
                   help="medusa format: base_model_name_or_path to write into config.json")
    p.add_argument("--overwrite", action="store_true", help="replace the checkpoint files in a non-empty DST")
    p.set_defaults(func=cmd_export)
