"""What every trainer's command does before and after the loop: load the target, read and split
conversations, tokenize, and write ``train_meta.json`` (the model card's numbers)."""
from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .data import TokenizedExample, load_conversations, split_ids, tokenize_all


@dataclass
class Prepared:
    target: object              # LoadedModel
    train: list[TokenizedExample]
    heldout: list[TokenizedExample]
    data_summary: str


def load_many(paths: list[str], limit: int | None) -> tuple[list, str]:
    """Conversations of several files in order; an id seen in an earlier file wins (put the
    regenerated file before the original dataset). ``limit`` applies per file."""
    convs, seen, notes = [], set(), []
    for path in paths:
        got, report = load_conversations(path, limit=limit)
        new = [c for c in got if c.id not in seen]
        seen.update(c.id for c in new)
        convs += new
        notes.append(f"{path}: {report.summary()}; {len(new)} used")
    return convs, " | ".join(notes)


def prepare_data(model: str, data: str | list[str], *, max_length: int, heldout_fraction: float,
                 limit: int | None, split_seed: int = 0, dtype: str = "float32",
                 device: str | torch.device | None = "cpu", weights: str = "dense") -> Prepared:
    """The frozen target (on this process's ``loop.training_device(device)``: each rank's GPU under
    torchrun) and the tokenized train / held-out split. ``weights``: the target's weights
    (``load_model``), so that a head learns the features of the target it will draft beside."""
    from ..models.loading import load_model
    from .loop import training_device
    target = load_model(model, dtype=dtype, device=training_device(device), weights=weights)
    convs, report = load_many([data] if isinstance(data, str) else list(data), limit)
    train_c, held_c = split_ids(convs, heldout_fraction, split_seed)
    train = tokenize_all(target.tokenizer, train_c, max_length)
    held = tokenize_all(target.tokenizer, held_c, max_length)
    summary = (f"{report}; {len(train)} train / {len(held)} held-out sequences, "
               f"{sum(len(e.input_ids) for e in train)} train tokens "
               f"({sum(sum(e.loss_mask) for e in train)} under the loss mask)")
    print(summary, file=sys.stderr)
    if not train:
        raise ValueError(f"no trainable sequences in {data}")
    return Prepared(target, train, held, summary)


def is_rank0() -> bool:
    """True in a single process and on rank 0 under torchrun (which sets RANK)."""
    import os
    return int(os.environ.get("RANK", "0")) == 0


def write_meta(out_dir: Path, prep: Prepared, result, extra: dict) -> dict:
    """Write ``train_meta.json`` (rank 0 only) and return its content."""
    meta = {
        "command": "verispec " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv else "",
        "data": prep.data_summary, "train_sequences": len(prep.train), "heldout_sequences": len(prep.heldout),
        "train_tokens": sum(len(e.input_ids) for e in prep.train),
        "steps": result.steps, "wall_time_s": round(result.seconds, 1), "final_train": result.last,
        "batch_size": getattr(result, "batch_size", None),
        "heldout": result.eval, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    } | extra
    if not is_rank0():
        return meta
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train_meta.json").write_text(json.dumps(meta, indent=2))
    return meta
PROFILE_WIDTH = 8


@torch.no_grad()
def topk_hits(logits: torch.Tensor, target_ids: torch.Tensor, valid: torch.Tensor, step: int,
              width: int = PROFILE_WIDTH) -> dict[str, torch.Tensor]:
    """``hit{step}@{k}`` = [positions whose target id is among the head's top k, valid positions]
    for k = 1..width (evaluation only: the acceptance profile of ``draft_shape``)."""
    top = torch.topk(logits.float(), min(width, logits.shape[-1]), dim=-1).indices
    rank_hit = (top == target_ids[..., None]) & valid[..., None]                 # [B, L, width]
    cum = rank_hit.cumsum(-1).bool().flatten(0, -2).sum(0).float()
    n = valid.sum().float()
    return {f"hit{step}@{k + 1}": torch.stack([cum[k], n]) for k in range(cum.shape[0])}


