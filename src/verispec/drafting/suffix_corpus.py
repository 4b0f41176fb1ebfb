"""A suffix corpus: answers the target wrote itself, loaded into suffix decoding's global tree
before the first request (``speculative_config`` key ``suffix_decoding_corpus``).

SuffixDecoding's global tree holds the outputs of earlier requests, so a fresh process drafts
from nothing but the request's own prompt and output until traffic has filled it. A corpus fills
it at start: a small model's greedy answers repeat their phrasing across prompts ("Here are some
...", list scaffolds, closing lines), and a tree of its own earlier answers drafts those spans.
This is REST's datastore idea (He et al., arXiv 2311.08252) on the tree SuffixDecoding already
keeps. It is lossless like every draft: the target verifies each token.

**File**: ``corpus.safetensors`` in a folder (or the file itself): ``tokens`` (int32, every
answer's ids end to end) and ``offsets`` (int64, answer ``i`` is ``tokens[offsets[i]:offsets[i+1]]``),
with metadata ``model`` and ``vocab_size`` (the target's embedding rows). ``verispec data
suffix-corpus`` writes it from ``verispec data regenerate``'s JSONL (the assistant turns,
chat-templated and tokenized as the trainer does).

**Shipped**: ``checkpoints/<model>-suffix-corpus/`` (``drafting.shipped``'s roots), found by the
setting ``"auto"``. Use only answers to prompts outside every evaluation set.

**Off by default**, because on this project's CPU fast path it barely pays: SmolLM2-135M's corpus
(2,608 answers) raises suffix decoding's tokens per step by 9% on Spec-Bench but its speed by
1-2%. The draft gate drafts more steps (81% against 59%), and the extra ones are marginal:
a verify over one more token costs about 10% of an int4 step, about what the weak matches they
draft earn (``benchmarks/results/spec_bench/suffix_corpus_smollm2``). Where a wider verify is
cheap (a GPU, fp16 weights) or traffic repeats itself (agent loops), the same tokens per step
are worth more.

**Cost**: the global tree takes about 0.3 M tokens a second to load on this project's 2-core CPU
(a 0.5 M-token corpus: under 2 s once per ``LLM`` or server) and at most about 115 MiB per 0.5 M
tokens (random ids; real text shares more). Loaded answers count against
``suffix_decoding_max_cached_requests`` and are the first evicted (FIFO) once real outputs exceed it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import torch

from .shipped import shipped_folder
from .spec_config import SpecConfigError

CORPUS_FILE = "corpus.safetensors"
AUTO = "auto"


def corpus_file(path: str | Path) -> Path:
    """The ``corpus.safetensors`` of a folder, or ``path`` itself when it is a file."""
    p = Path(path)
    return p / CORPUS_FILE if p.is_dir() else p


def shipped_corpus(model_name: str) -> Path | None:
    """``<root>/<model>-suffix-corpus/corpus.safetensors`` under the first checkpoint root holding it."""
    folder = shipped_folder(model_name, "suffix-corpus", CORPUS_FILE)
    return None if folder is None else folder / CORPUS_FILE


def answer_spans(input_ids: Sequence[int], loss_mask: Sequence[int]) -> list[list[int]]:
    """The maximal runs of ``input_ids`` under the loss mask: one list per assistant turn."""
    spans, cur = [], []
    for t, m in zip(input_ids, loss_mask):
        if m:
            cur.append(int(t))
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    return spans


def save_corpus(answers: Iterable[Sequence[int]], path: str | Path, *, model: str, vocab_size: int,
                info: dict | None = None) -> dict:
    """Write ``answers`` (token id lists) as a corpus file (``path``: a folder or a ``.safetensors``
    file); returns the summary written into its metadata."""
    from safetensors.torch import save_file
    seqs = [list(map(int, a)) for a in answers if len(a) > 0]
    if not seqs:
        raise ValueError("a suffix corpus needs at least one non-empty answer")
    flat = [t for s in seqs for t in s]
    bad = [t for t in flat if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary of {vocab_size}")
    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s))
    summary = {"model": model, "vocab_size": int(vocab_size), "answers": len(seqs), "tokens": len(flat),
               **(info or {})}
    out = Path(path)
    if out.suffix != ".safetensors":
        out.mkdir(parents=True, exist_ok=True)
        out = out / CORPUS_FILE
    save_file({"tokens": torch.tensor(flat, dtype=torch.int32), "offsets": torch.tensor(offsets, dtype=torch.int64)},
              str(out), metadata={k: json.dumps(v) for k, v in summary.items()})
    return summary


def load_corpus(path: str | Path, vocab_size: int | None = None) -> list[list[int]]:
    """The answers of a corpus file or folder, checked: a ``SpecConfigError`` for a missing or
    corrupt file, inconsistent offsets, or ids outside ``vocab_size`` (another tokenizer's corpus)."""
    from safetensors import safe_open
    f = corpus_file(path)
    if not f.is_file():
        raise SpecConfigError(f"suffix_decoding_corpus {str(path)!r}: no such file (expected a folder with "
                              f"{CORPUS_FILE} or the file itself; `verispec data suffix-corpus` writes one)")
    try:
        with safe_open(str(f), framework="pt") as st:
            meta = {k: json.loads(v) for k, v in (st.metadata() or {}).items()}
            tokens, offsets = st.get_tensor("tokens"), st.get_tensor("offsets")
    except Exception as e:            # safetensors raises several types for a damaged file
        raise SpecConfigError(f"suffix_decoding_corpus {str(f)!r} is not a readable corpus file: {e}") from None
    n = tokens.numel()
    ok = (tokens.dim() == 1 and offsets.dim() == 1 and offsets.numel() >= 2 and int(offsets[0]) == 0
          and int(offsets[-1]) == n and bool((offsets[1:] >= offsets[:-1]).all()))
    if not ok:
        raise SpecConfigError(f"suffix_decoding_corpus {str(f)!r}: 'offsets' do not cut 'tokens' into answers")
    if vocab_size is not None:
        if meta.get("vocab_size") not in (None, vocab_size) or (n and int(tokens.max()) >= vocab_size) \
                or (n and int(tokens.min()) < 0):
            raise SpecConfigError(f"suffix_decoding_corpus {str(f)!r} was written for a vocabulary of "
                                  f"{meta.get('vocab_size')} ({meta.get('model')}), the target has {vocab_size}: "
                                  "a corpus must come from the target's own tokenizer")
    flat, cuts = tokens.tolist(), offsets.tolist()
    return [flat[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]


def resolve_corpus(setting: str | None, target) -> list[list[int]] | None:
    """The answers ``setting`` names for ``target``: ``"auto"`` the target's shipped corpus (none
    when nothing is shipped for it), None nothing, else a corpus path."""
    if setting is None:
        return None
    vocab = getattr(getattr(target, "config", None), "vocab_size", None)
    if setting == AUTO:
        found = shipped_corpus(getattr(target, "name", "") or "")
        return load_corpus(found, vocab) if found is not None else None
    return load_corpus(setting, vocab)
