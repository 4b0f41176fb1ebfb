"""Building a reduced draft vocabulary from training data (``DraftVocab``: ``verispec.drafting.draft_vocab``).

The draft head predicts over the ``D`` target tokens most frequent among the training targets
(assistant tokens under the loss mask). Maps, as the checkpoints store them:
- ``d2t [D]`` int64 offsets: target id = draft id + d2t[draft id];
- ``t2d [V]`` bool: which target ids are in the draft vocabulary.
Draft ids are the chosen target ids in increasing order, so the map is monotone and stable.
"""
from __future__ import annotations

from typing import Iterable

import torch

from ..drafting.draft_vocab import DraftVocab


def token_counts(sequences: Iterable[tuple[Iterable[int], Iterable[int]]], vocab_size: int) -> torch.Tensor:
    """[V] counts of tokens under the loss mask; ``sequences`` yields (ids, mask) pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in sequences:
        ids_t = torch.tensor([i for i, m in zip(ids, mask) if m], dtype=torch.long)
        if ids_t.numel():
            if int(ids_t.max()) >= vocab_size or int(ids_t.min()) < 0:
                raise ValueError(f"token id out of range for a vocabulary of {vocab_size}")
            counts += torch.bincount(ids_t, minlength=vocab_size)
    return counts


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int,
                      always: Iterable[int] = ()) -> DraftVocab:
    """The ``draft_vocab_size`` most frequent ids (ties: lower id first), plus ``always`` (e.g.
    end-of-turn ids) which take the places of the least frequent picks."""
    v = counts.numel()
    if not 0 < draft_vocab_size <= v:
        raise ValueError(f"draft_vocab_size must be in 1..{v}, got {draft_vocab_size}")
    always = sorted({int(a) for a in always})
    if len(always) > draft_vocab_size or any(not 0 <= a < v for a in always):
        raise ValueError(f"'always' ids {always} do not fit a draft vocabulary of {draft_vocab_size} over {v}")
    order = sorted(range(v), key=lambda i: (-int(counts[i]), i))
    fixed = set(always)
    picked = [i for i in order if i not in fixed][: draft_vocab_size - len(always)] + always
    return DraftVocab.from_ids(torch.tensor(picked, dtype=torch.long), v)
