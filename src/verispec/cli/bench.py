"""``verispec bench``: Spec-Bench-style speedup and acceptance report, peers side by side.

Runs the requested methods on the same Spec-Bench questions (interleaved, one process), then
writes ``results.json``, ``report.md`` and PNG plots into ``--out`` and prints the speedup table.
Exit codes: 0 done, 2 bad input (dataset, category, method, config), 1 model or runtime failure,
130 interrupted (no result file is half-written; earlier files are left as they were).
"""
from __future__ import annotations

import argparse
import json
import sys

from ..bench import BenchError
from ..models.device import add_device_argument, add_weights_argument
from ..bench.runner import DEFAULT_METHODS, METHOD_NAMES, PRESETS, BenchConfig

DEFAULT_OUT = "bench_results"


def _csv(text: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in _csv(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("batch sizes must be positive")
    return values


def _method_config(text: str) -> tuple[str, dict]:
    name, sep, raw = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=JSON, got {text!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{name}: invalid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{name}: the config must be a JSON object")
    return name.strip(), value


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The ``BenchConfig`` the command line describes."""
    return BenchConfig(
        model=args.model, methods=args.methods, method_configs=dict(args.method_config or []),
        preset=args.preset, dataset=args.dataset, categories=args.categories,
        per_category=args.per_category or None, max_tokens=args.max_tokens, temperature=args.temperature,
        batch_sizes=args.batch_sizes, repeats=args.repeats, dtype=args.dtype, weights=args.weights, device=args.device,
        compile=args.compile,
        threads=args.threads,
        hf_weights=args.hf_weights, warmup_tokens=args.warmup_tokens, name=args.name, notes=args.notes or "")


def cmd_bench(args: argparse.Namespace) -> int:
    from ..bench.report import headline, summarize, write_report
    from ..bench.runner import run_benchmark
    from ..models.sources import ModelSourceError
    try:
        config = config_from_args(args)
        result = run_benchmark(config, progress=not args.no_progress)
        files = write_report(args.out, [result])
    except BenchError as e:
        print(f"verispec bench: {e}", file=sys.stderr)
        return 2
    except ModelSourceError as e:
        print(f"verispec bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("verispec bench: interrupted; no result file was written", file=sys.stderr)
        return 130
    print(f"Speedup over vanilla ({result.config['model']}, batch {min(config.batch_sizes)}):\n")
    print(headline(result, summarize(result)))
    for m in result.methods:
        if m.unavailable:
            print(f"\n{m.name}: unavailable: {m.unavailable}")
    print("\nwrote " + ", ".join(str(f) for f in files))
    return 0


def add_parser(subparsers) -> None:
    """Register ``bench`` on an argparse ``subparsers`` object (handler: ``args.func(args) -> int``)."""
    p = subparsers.add_parser(
        "bench", help="Spec-Bench-style speedup/acceptance benchmark with HF peers and plots",
        description="Run methods side by side on Spec-Bench questions (multi-turn like Spec-Bench), "
                    "interleaved per batch in one process, and write results.json, report.md and "
                    "PNG plots. Speedups are over verispec's vanilla decoding in the same run.")
    p.add_argument("--model", default="smollm2-135m", help="target model (known name, .gguf or HF folder)")
    p.add_argument("--methods", type=_csv, default=DEFAULT_METHODS,
                   help=f"comma-separated methods (default {','.join(DEFAULT_METHODS)}); built in: "
                        f"{', '.join(METHOD_NAMES)}; any other name needs --method-config")
    p.add_argument("--method-config", type=_method_config, action="append", metavar="NAME=JSON",
                   help="speculative_config of a method (repeatable), e.g. "
                        "'ngram={\"method\":\"ngram\",\"num_speculative_tokens\":3}'; HF peers take "
                        "generate options, e.g. 'hf-pld={\"prompt_lookup_num_tokens\":10}'; add "
                        "\"peer\":\"hf-pld\" to a new name to make it an HF peer")
    p.add_argument("--preset", choices=PRESETS, help="add the EAGLE-2 ablation methods (eagle3 variants)")
    p.add_argument("--dataset", help="Spec-Bench-format JSONL (question_id, category, turns); "
                                     "default: the shipped Spec-Bench questions")
    p.add_argument("--categories", type=_csv, help="comma-separated categories to keep (default all)")
    p.add_argument("--per-category", type=int, default=1, metavar="N",
                   help="first N questions of each category (default 1; 0 = all)")
    p.add_argument("--max-tokens", type=int, default=128, help="max new tokens per turn (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--batch-sizes", type=_ints, default=(1,), metavar="B[,B...]",
                   help="batch sizes to sweep, e.g. 1,4,8,32 (default 1)")
    p.add_argument("--repeats", type=int, default=1, help="runs of every batch per method (default 1)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default float32)")
    add_weights_argument(p)
    p.add_argument("--compile", action="store_true", help="verispec's decode/verify forwards through torch.compile "
                   "(compiled during the warm-up; see models/compiled.py)")
    add_device_argument(p)
    p.add_argument("--threads", type=int, help="torch threads for every method (default: torch's)")
    p.add_argument("--hf-weights", choices=("loader", "shared"), default="loader",
                   help="HF peers load the checkpoint with HF's own loader (default) or reuse "
                        "verispec's loaded tensors (instant, same numbers)")
    p.add_argument("--warmup-tokens", type=int, default=16, help="tokens of the untimed warm-up call")
    p.add_argument("--name", default="spec-bench", help="suite name in the report")
    p.add_argument("--notes", help="free text added to the report")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=cmd_bench)
