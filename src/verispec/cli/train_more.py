"""``verispec train eagle`` (EAGLE-1) and ``verispec train medusa`` (Medusa-1, ``--medusa2``).

Same flow as ``verispec train eagle3``: load the target and the conversations
(``train.common.prepare_data``), run the task on ``train.loop.Trainer`` (torchrun-ready), write
``train_meta.json``. The checkpoint goes to ``OUT/checkpoint``: an EAGLE-1 head folder, a Medusa
heads folder, or (Medusa-2) the new backbone as a Hugging Face folder with the heads in
``OUT/checkpoint/medusa``.
"""
from __future__ import annotations

import argparse
from pathlib import Path


def _setup(args):
    import torch
    from ..train.common import prepare_data
    if args.threads:
        torch.set_num_threads(args.threads)
    return prepare_data(args.model, args.data, max_length=args.max_length,
                        heldout_fraction=args.heldout_fraction, limit=args.limit, device=args.device,
                        weights=args.target_weights)


def _save_dtype(args):
    import torch
    return torch.bfloat16 if args.save_dtype == "bf16" else torch.float32


def cmd_eagle(args: argparse.Namespace, train_config) -> int:
    from ..train.common import write_meta
    from ..train.eagle1 import Eagle1Task, init_eagle1_head, new_eagle1_config
    from ..train.loop import Trainer
    prep = _setup(args)
    target = prep.target.model
    head = init_eagle1_head(new_eagle1_config(target.cfg, fc_bias=args.fc_bias), target, seed=args.seed)
    task = Eagle1Task(target, head, v_weight=args.v_weight, p_weight=args.p_weight, noise=args.noise,
                      noise_seed=args.seed)
    task.save_dtype = _save_dtype(args)
    result = Trainer(task, prep.train, prep.heldout, train_config(args)).fit()
    write_meta(Path(args.out), prep, result, {
        "method": "eagle", "v_weight": args.v_weight, "p_weight": args.p_weight, "noise": args.noise,
        "fc_bias": args.fc_bias})
    print(f"wrote {Path(args.out) / 'checkpoint'}; held-out: {result.eval}")
    return 0


def cmd_medusa(args: argparse.Namespace, train_config) -> int:
    from ..train.common import write_meta
    from ..train.loop import Trainer
    from ..train.medusa import MEDUSA_DIR, Medusa1Task, Medusa2Task, init_medusa_heads, new_medusa_config
    prep = _setup(args)
    target = prep.target.model
    cfg = new_medusa_config(target.cfg, args.num_heads, args.num_layers, args.tied_lm_head)
    if args.init_from:
        from ..formats import load_medusa_heads
        heads = load_medusa_heads(args.init_from, target).float().requires_grad_(True).train()
        cfg = heads.cfg
    else:
        heads = init_medusa_heads(cfg, target)
    if args.eval_only and (args.medusa2 or not args.init_from):
        raise SystemExit("--eval-only needs --init-from (Medusa-1 heads to evaluate)")
    if args.medusa2:
        task = Medusa2Task(target, heads, decay=args.decay, heads_coefficient=args.heads_coefficient,
                           kl_weight=args.kl_weight)
        task.tokenizer = prep.target.tokenizer
    else:
        task = Medusa1Task(target, heads, decay=args.decay, labels=args.labels)
    task.save_dtype = _save_dtype(args)
    if args.eval_only:
        import dataclasses

        from .train_eval import eval_only
        no_resume = dataclasses.replace(train_config(args), resume=False)
        return eval_only(args, Trainer(task, prep.train, prep.heldout, no_resume), len(prep.heldout),
                          depth=heads.cfg.num_heads)
    result = Trainer(task, prep.train, prep.heldout, train_config(args)).fit()
    extra = {"method": "medusa2" if args.medusa2 else "medusa1", "num_heads": args.num_heads,
             "num_layers": args.num_layers, "tied_lm_head": args.tied_lm_head, "decay": args.decay,
             "labels": "data" if args.medusa2 else args.labels}
    if args.medusa2:
        extra |= {"heads_coefficient": args.heads_coefficient, "kl_weight": args.kl_weight,
                  "layout": {"backbone": "checkpoint/ (Hugging Face folder)", "heads": f"checkpoint/{MEDUSA_DIR}/"}}
    write_meta(Path(args.out), prep, result, extra)
    ckpt = Path(args.out) / "checkpoint"
    where = f"backbone {ckpt}, heads {ckpt / MEDUSA_DIR}" if args.medusa2 else str(ckpt)
    print(f"wrote {where}; held-out: {result.eval}")
    return 0


def add_more_parsers(tsub, common, train_config) -> None:
    e1 = tsub.add_parser("eagle", help="EAGLE-1 head (feature regression + token loss, input noise)")
    common(e1)
    e1.add_argument("--v-weight", type=float, default=1.0, help="feature regression (smooth L1) weight")
    e1.add_argument("--p-weight", type=float, default=0.1, help="token loss (soft cross-entropy) weight")
    e1.add_argument("--noise", type=float, default=0.2, help="uniform input-feature noise width (0: none)")
    e1.add_argument("--fc-bias", action=argparse.BooleanOptionalAction, default=True,
                    help="bias on the head's fc (the EAGLE repo has one)")
    e1.set_defaults(func=lambda a: cmd_eagle(a, train_config))

    md = tsub.add_parser("medusa", help="Medusa-1 heads (frozen target) or Medusa-2 (--medusa2: backbone too)")
    common(md)
    md.add_argument("--num-heads", type=int, default=4)
    md.add_argument("--num-layers", type=int, default=1, help="residual blocks per head")
    md.add_argument("--tied-lm-head", action=argparse.BooleanOptionalAction, default=True,
                    help="project with the target's lm_head (small checkpoint) or train one per head")
    md.add_argument("--decay", type=float, default=0.8, help="head k's loss weight is decay**k")
    md.add_argument("--labels", choices=("data", "target"), default="target",
                    help="Medusa-1 labels: the target's greedy token after the data prefix (self-distilled, "
                         "default) or the data token")
    md.add_argument("--medusa2", action="store_true",
                    help="train a copy of the backbone jointly (self-distilled); writes a new model")
    md.add_argument("--heads-coefficient", type=float, default=0.2, help="Medusa-2: weight of the head losses")
    md.add_argument("--kl-weight", type=float, default=1.0, help="Medusa-2: weight of the backbone distillation")
    md.add_argument("--init-from", help="Medusa-1 heads folder to start from (warm start or --eval-only)")
    md.add_argument("--eval-only", action="store_true",
                    help="only evaluate the --init-from heads on the held-out split (writes <out>/eval.json and "
                         "<out>/acceptance.json, the profile draft shapes are chosen from)")
    md.set_defaults(func=lambda a: cmd_medusa(a, train_config))
