"""Reduced draft vocabulary (EAGLE-3 / SpecForge ``d2t`` / ``t2d``), shared by trained heads and by
draft models that predict over a subset of the target's tokens.

A drafter whose LM head keeps only the ``D`` most frequent target tokens reads a fraction of the
head's bytes per token; tokens outside the subset are never proposed (their draft probability is
0), so verification stays exactly lossless and only acceptance can drop, by at most the share of
target tokens the subset misses (``coverage``).

Maps, as the checkpoints store them:
- ``d2t [D]`` int64 offsets: target id = draft id + d2t[draft id];
- ``t2d [V]`` bool: which target ids are in the draft vocabulary.
Draft ids are the chosen target ids in increasing order, so the map is monotone and stable.
A standalone vocabulary file (``save_draft_vocab``) is a safetensors file holding both maps.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class DraftVocab:
    d2t: torch.Tensor           # [D] int64 offsets
    t2d: torch.Tensor           # [V] bool

    @property
    def size(self) -> int:
        return self.d2t.numel()

    @property
    def draft_ids(self) -> torch.Tensor:
        """[D] target ids of the draft vocabulary, increasing."""
        return torch.arange(self.size, device=self.d2t.device) + self.d2t

    def target_to_draft(self) -> torch.Tensor:
        """[V] int64: draft id of each target id, -1 outside the draft vocabulary."""
        dev = self.d2t.device
        out = torch.full(self.t2d.shape, -1, dtype=torch.long, device=dev)
        out[self.draft_ids] = torch.arange(self.size, device=dev)
        return out

    def to(self, device: str | torch.device) -> "DraftVocab":
        """The same vocabulary with its maps on ``device``."""
        return DraftVocab(self.d2t.to(device), self.t2d.to(device))

    def coverage(self, counts: torch.Tensor) -> float:
        """Share of counted target tokens that the draft vocabulary contains."""
        total = float(counts.sum())
        return float(counts[self.t2d].sum()) / total if total else 0.0

    @classmethod
    def from_ids(cls, ids: torch.Tensor, vocab_size: int) -> "DraftVocab":
        """From target ids (any order); raises on repeats or ids outside ``0..vocab_size-1``."""
        ids = torch.as_tensor(ids).long().flatten().sort().values
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
            raise ValueError(f"draft vocabulary ids must lie in 0..{vocab_size - 1} and not be empty")
        if ids.unique().numel() != ids.numel():
            raise ValueError("draft vocabulary ids repeat")
        t2d = torch.zeros(vocab_size, dtype=torch.bool, device=ids.device)
        t2d[ids] = True
        return cls(d2t=ids - torch.arange(ids.numel(), device=ids.device), t2d=t2d)


def save_draft_vocab(vocab: DraftVocab, path: str | Path, info: dict | None = None) -> Path:
    """Write ``d2t`` and ``t2d`` to a safetensors file; ``info`` (JSON-able) goes in its metadata."""
    from safetensors.torch import save_file
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": "verispec-draft-vocab", "vocab_size": str(vocab.t2d.numel()),
            "draft_vocab_size": str(vocab.size), "info": json.dumps(info or {})}
    save_file({"d2t": vocab.d2t.contiguous(), "t2d": vocab.t2d.contiguous()}, str(path), metadata=meta)
    return path


def load_draft_vocab(path: str | Path, vocab_size: int) -> DraftVocab:
    """Read a file written by ``save_draft_vocab`` (or any safetensors file with ``d2t``, as EAGLE-3
    checkpoints store it) for a target of ``vocab_size`` tokens. Every defect is a ``ValueError``
    naming the file: missing, unreadable, no ``d2t``, ids out of range or repeated, ``t2d`` that
    disagrees, or a vocabulary made for another vocabulary size."""
    from safetensors import safe_open
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"draft vocabulary file {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            if "d2t" not in names:
                raise ValueError(f"draft vocabulary file {path} has no 'd2t' tensor (has {sorted(names)})")
            d2t = f.get_tensor("d2t")
            t2d = f.get_tensor("t2d") if "t2d" in names else None
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"draft vocabulary file {path} is not a readable safetensors file: {e}") from e
    if d2t.dim() != 1 or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise ValueError(f"{path}: d2t must be a 1-D integer tensor, got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d is not None and t2d.numel() != vocab_size:
        raise ValueError(f"{path}: made for a vocabulary of {t2d.numel()} tokens, the target has {vocab_size}")
    try:
        vocab = DraftVocab.from_ids(torch.arange(d2t.numel()) + d2t.long(), vocab_size)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if not torch.equal(vocab.d2t, d2t.long()):
        raise ValueError(f"{path}: d2t does not list increasing target ids")
    if t2d is not None and not torch.equal(t2d.bool(), vocab.t2d):
        raise ValueError(f"{path}: t2d does not mark exactly the ids d2t maps to")
    return vocab


FOLDER_FILE = "draft_vocab.safetensors"     # a head folder's runtime draft vocabulary (used by default)


def head_vocab_file(setting: str | None, head_folder: str | Path | None) -> Path | None:
    """Which draft-vocabulary file a head drafts over: ``setting`` names a file (relative names are
    also looked up under the checkpoint roots), ``"full"`` asks for none; unset, the head folder's
    ``draft_vocab.safetensors`` when it has one. Returns None for the head's own vocabulary."""
    from .shipped import in_checkpoints
    if setting == "full":
        return None
    if setting is not None:
        return in_checkpoints(setting)
    path = Path(head_folder) / FOLDER_FILE if head_folder is not None else None
    return path if path is not None and path.is_file() else None


def head_vocab(setting: str | None, head_folder: str | Path | None, vocab_size: int) -> DraftVocab | None:
    """The vocabulary ``head_vocab_file`` names, loaded for ``vocab_size`` (None: the head's own);
    a bad file is a ``SpecConfigError`` naming the ``draft_vocab`` key."""
    from .spec_config import SpecConfigError
    path = head_vocab_file(setting, head_folder)
    if path is None:
        return None
    try:
        return load_draft_vocab(path, vocab_size)
    except ValueError as e:
        raise SpecConfigError(f"speculative_config 'draft_vocab': {e}") from None


def check_ids(ids, vocab_size: int) -> torch.Tensor:
    """``ids`` as a flat int64 tensor of distinct target ids in ``0..vocab_size-1``; ``ValueError``
    otherwise (what a head's ``restrict_vocab_`` accepts)."""
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != ids.numel():
        raise ValueError(f"a draft vocabulary must be distinct target ids in 0..{vocab_size - 1}, got {ids.numel()} ids")
    return ids


def rows_linear(weight: torch.Tensor, ids: torch.Tensor) -> torch.nn.Linear:
    """A bias-free ``nn.Linear`` holding a copy of rows ``ids`` of ``weight`` [V, h] (a head's cut of
    the target's LM head: the target's own stays untouched), on ``weight``'s device and dtype."""
    w = weight[ids.to(weight.device)]
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin
