"""``verispec data features``: the offline target-feature cache (see ``train/features.py``)."""
from __future__ import annotations

import argparse

from ..models.device import add_device_argument
from .train import add_target_weights_argument


def cmd_features(args: argparse.Namespace) -> int:
    import torch
    from ..drafting.eagle_head import EagleHeadConfig
    from ..train.common import prepare_data
    from ..train.features import write_features
    if args.threads:
        torch.set_num_threads(args.threads)
    prep = prepare_data(args.model, args.data, max_length=args.max_length, heldout_fraction=args.heldout_fraction,
                        limit=args.limit, device=args.device, weights=args.target_weights)
    n = prep.target.model.cfg.num_layers
    ids = tuple(args.aux_layer_ids) if args.aux_layer_ids else EagleHeadConfig.default_aux_layer_ids(n)
    layers = tuple(k - 1 for k in ids)
    write_features(prep.target.model, prep.train + prep.heldout, args.out, layers, dtype=args.dtype,
                   model_name=args.model, progress=not args.quiet)
    print(f"wrote {args.out} (layers {list(layers)} = aux ids {list(ids)})")
    return 0


def add_features_parser(dsub) -> None:
    f = dsub.add_parser("features", help="cache target hidden states offline (safetensors shards)")
    f.add_argument("--model", default="smollm2-135m")
    f.add_argument("--data", required=True, nargs="+")
    f.add_argument("--out", required=True)
    f.add_argument("--max-length", type=int, default=512, help="same as the trainer's")
    f.add_argument("--limit", type=int)
    f.add_argument("--heldout-fraction", type=float, default=0.05, help="same as the trainer's")
    f.add_argument("--aux-layer-ids", type=int, nargs=3, help="vLLM ids (k = output of layer k-1)")
    f.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    f.add_argument("--threads", type=int)
    add_device_argument(f)
    add_target_weights_argument(f)
    f.add_argument("--quiet", action="store_true")
    f.set_defaults(func=cmd_features)
