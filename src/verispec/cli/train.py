"""``verispec train eagle3|eagle|medusa``: train draft heads (runs unchanged under torchrun)."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..models.device import add_device_argument


def add_target_weights_argument(p: argparse.ArgumentParser) -> None:
    """``--target-weights``: the frozen target's weights while its features are read (training,
    feature capture): those of the target the head will draft beside (``auto`` is the default
    everywhere else; here ``dense`` keeps older runs reproducible)."""
    from ..models.auto_weights import AUTO
    from ..models.packed import WeightFormat
    p.add_argument("--target-weights", choices=[AUTO] + [w.value for w in WeightFormat], default="dense",
                   help="the target's weights while its features are read (default: %(default)s)")
from .train_eval import eval_only

DRAFT_LOSSES = ("soft", "hard", "lk", "soft+hard")     # train.eagle3.DraftLoss (not imported: torch-free parser)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="target model (name or path)")
    p.add_argument("--data", required=True, nargs="+",
                   help="ShareGPT JSON / SpecForge JSONL files; on repeated ids the earlier file wins")
    p.add_argument("--out", required=True, help="run folder: log.jsonl, train_state.pt, checkpoint/")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--limit", type=int, help="first N conversations of each file")
    p.add_argument("--stop-after", type=int, help="end this run after N steps (resume later)")
    p.add_argument("--heldout-fraction", type=float, default=0.05)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--max-steps", type=int)
    p.add_argument("--batch-size", type=int, default=8, help="global sequences per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-ratio", type=float, default=0.03)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="training compute dtype")
    p.add_argument("--save-dtype", choices=("fp32", "bf16"), default="bf16", help="checkpoint dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--threads", type=int)
    add_device_argument(p)
    add_target_weights_argument(p)
    p.add_argument("--quiet", action="store_true")


def train_config(args):
    from ..train.loop import TrainConfig
    return TrainConfig(out_dir=Path(args.out), epochs=args.epochs, max_steps=args.max_steps,
                       batch_size=args.batch_size, micro_batch_size=args.micro_batch_size, lr=args.lr,
                       warmup_ratio=args.warmup_ratio, max_grad_norm=args.max_grad_norm, dtype=args.dtype,
                       seed=args.seed, log_every=args.log_every, eval_every=args.eval_every,
                       save_every=args.save_every, resume=not args.no_resume, progress=not args.quiet,
                       stop_after=args.stop_after, device=args.device)


def cmd_eagle3(args: argparse.Namespace) -> int:
    import dataclasses

    import torch
    from ..train.common import is_rank0, prepare_data, write_meta
    from ..train.eagle3 import Eagle3Task, init_eagle3_head, new_head_config
    from ..train.loop import Trainer
    from ..train.vocab import build_draft_vocab, token_counts
    if args.eval_only and not args.init_from:
        raise SystemExit("--eval-only needs --init-from (the head to evaluate)")
    if args.init_from and (args.head_init or args.intermediate_size):
        raise SystemExit("--head-init / --intermediate-size shape a new head; --init-from warm-starts an existing "
                         "one: give one")
    if args.threads:
        torch.set_num_threads(args.threads)
    prep = prepare_data(args.model, args.data, max_length=args.max_length,
                        heldout_fraction=args.heldout_fraction, limit=args.limit, device=args.device,
                        weights=args.target_weights)
    target = prep.target.model
    vocab_path = Path(args.out) / "draft_vocab.pt"
    counts = token_counts(((e.input_ids, e.loss_mask) for e in prep.train), target.cfg.vocab_size)
    if args.init_from:
        head, vocab = _warm_head(args, target)
    else:
        if vocab_path.exists() and not args.no_resume:
            vocab = torch.load(vocab_path, weights_only=False, map_location="cpu")   # resume: the first run's vocabulary
        else:
            eos = [i for i in prep.target.config.eos_token_ids if i < target.cfg.vocab_size]
            vocab = build_draft_vocab(counts, min(args.draft_vocab_size, target.cfg.vocab_size), always=eos)
        cfg = new_head_config(target.cfg, vocab.size, tuple(args.aux_layer_ids) if args.aux_layer_ids else None,
                              fc_norm=args.eagle31, norm_output=args.eagle31, intermediate_size=args.intermediate_size)
        head = init_eagle3_head(cfg, target, vocab, seed=args.seed, init=args.head_init or "target")
    if is_rank0():                      # every rank has the same vocabulary (same data or same head)
        vocab_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(vocab, vocab_path)
    features = None
    if args.features:
        from ..train.features import FeatureStore
        features = FeatureStore(args.features, head.aux_layers,
                                target.cfg.hidden_size)
    task = Eagle3Task(target, head, ttt_length=args.ttt_length, decay=args.ttt_decay, features=features,
                      loss=args.loss)
    task.save_dtype = torch.bfloat16 if args.save_dtype == "bf16" else torch.float32
    if args.eval_only:
        no_resume = dataclasses.replace(train_config(args), resume=False)   # evaluate the head, not a run's state
        return eval_only(args, Trainer(task, prep.train, prep.heldout, no_resume), len(prep.heldout))
    result = Trainer(task, prep.train, prep.heldout, train_config(args)).fit()
    write_meta(Path(args.out), prep, result, {
        "method": "eagle3.1" if args.eagle31 else "eagle3", "ttt_length": args.ttt_length, "loss": args.loss,
        "draft_vocab_size": vocab.size, "draft_vocab_coverage": round(vocab.coverage(counts), 4)})
    done = result.steps >= train_config(args).max_steps if args.max_steps else (Path(args.out) / "checkpoint").exists()
    last = Path(args.out) / "checkpoint-last"
    print(f"{'wrote ' + str(Path(args.out) / 'checkpoint') if done else f'stopped early (resume to finish; the head so far: {last})'}; "
          f"held-out: {result.eval}")
    return 0


def _warm_head(args: argparse.Namespace, target):
    """The head of ``--init-from`` (trainable, fp32) and its draft vocabulary; its config (draft
    vocabulary, aux layers, EAGLE-3.1 switches) replaces the ones the flags would choose."""
    from ..formats import load_eagle_head
    from ..drafting.eagle_head import HeadKind
    from ..train.vocab import DraftVocab
    head = load_eagle_head(args.init_from, target, HeadKind.EAGLE3)
    cfg = head.cfg
    if args.aux_layer_ids and tuple(args.aux_layer_ids) != cfg.aux_layer_ids:
        raise SystemExit(f"--aux-layer-ids {args.aux_layer_ids} differ from the --init-from head's {list(cfg.aux_layer_ids)}")
    if args.eagle31 and not (cfg.fc_norm and cfg.norm_output):
        raise SystemExit("--eagle31 given, but the --init-from head is an EAGLE-3 (not 3.1) head")
    head = head.float().train().requires_grad_(True)
    return head, DraftVocab(d2t=head.d2t.cpu().clone(), t2d=head.t2d.cpu().clone())     # saved and counted on the host


def cmd_ship(args: argparse.Namespace) -> int:
    import json
    from ..train.card import ship
    regen = json.loads(Path(args.regen_stats).read_text()) if args.regen_stats else None
    card = ship(Path(args.run), Path(args.dest), args.method, extra=[Path(f) for f in args.extra or []],
                bench=Path(args.bench) if args.bench else None,
                regen=regen, reproduce=args.reproduce or [], notes=args.note or [])
    print(f"wrote {card}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train draft heads (EAGLE-3, EAGLE-1, Medusa)")
    tsub = p.add_subparsers(dest="train_command", metavar="METHOD")
    e3 = tsub.add_parser("eagle3", help="EAGLE-3 head with training-time test")
    _common(e3)
    e3.add_argument("--ttt-length", type=int, default=7)
    e3.add_argument("--ttt-decay", type=float, default=0.8)
    e3.add_argument("--loss", choices=DRAFT_LOSSES, default="soft",
                    help="per-step loss against the target distribution (train.eagle3.DraftLoss): soft "
                         "cross-entropy, hard (the target argmax), lk (-log acceptance rate) or soft+hard "
                         "(default: %(default)s)")
    e3.add_argument("--draft-vocab-size", type=int, default=16384)
    e3.add_argument("--intermediate-size", type=int, default=None,
                    help="a new head's MLP width (default: the target's intermediate size)")
    e3.add_argument("--aux-layer-ids", type=int, nargs=3, help="vLLM ids (k = output of layer k-1)")
    e3.add_argument("--eagle31", action="store_true", help="EAGLE-3.1: fc_norm + norm_output")
    e3.add_argument("--head-init", choices=["random", "target", "target-layer"], default=None,
                    help="a new head's start: random; target (LM-head rows and final norm from the "
                         "target, the default); target-layer (also its decoder layer from the target's last); "
                         "not with --init-from")
    e3.add_argument("--init-from", help="warm start: an EAGLE-3 head folder (its draft vocabulary and "
                    "config are kept; a new optimizer and schedule start from step 0)")
    e3.add_argument("--eval-only", action="store_true",
                    help="only evaluate the --init-from head on the held-out split (writes <out>/eval.json)")
    e3.add_argument("--features", help="offline feature cache from `verispec data features` (default: online)")
    e3.set_defaults(func=cmd_eagle3)
    sh = tsub.add_parser("ship", help="copy a finished run's checkpoint to its shipped folder, with a model card")
    sh.add_argument("run")
    sh.add_argument("--dest", required=True)
    sh.add_argument("--method", required=True)
    sh.add_argument("--bench", help="benchmark results.json with rows for this method")
    sh.add_argument("--regen-stats", help="<regenerated>.jsonl.stats.json")
    sh.add_argument("--reproduce", action="append", help="a command line for the card (repeat)")
    sh.add_argument("--note", action="append", help="a line for the card's training section (repeat)")
    sh.add_argument("--extra", action="append", help="a file to ship beside the checkpoint (repeat): acceptance.json, "
                    "draft_vocab.safetensors (may be the destination's own)")
    sh.set_defaults(func=cmd_ship)
    try:
        from .train_more import add_more_parsers      # EAGLE-1 and Medusa trainers
        add_more_parsers(tsub, _common, train_config)
    except ImportError:
        pass
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])
