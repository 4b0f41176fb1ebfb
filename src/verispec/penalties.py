"""Repetition, frequency and presence penalties (and OpenAI's logit bias) on target logits, per
draft-tree node.

Definitions (OpenAI's and vLLM's):
- ``frequency_penalty`` f and ``presence_penalty`` r act on the *generated* tokens:
  ``logit[t] -= f * count(t) + r * (count(t) > 0)``;
- ``repetition_penalty`` rp (HF / CTRL) acts on every token seen, prompt and generated: a positive
  logit is divided by rp, a negative one multiplied by rp;
- ``logit_bias`` adds a fixed value per token id, then ``allowed_token_ids`` sets every other
  token to -inf.
They define the target distribution of the next token given everything before it. In a draft
tree the "generated" tokens of a node are the request's output so far (which ends with the root)
plus the node's own root path, so each row of the verification forward gets its own counts.
The verifier samples from these penalised target rows; drafters keep drafting from their own,
unpenalised distributions (q is whatever the draft was drawn from, so the acceptance stays
lossless; a penalty only lowers acceptance where it changes the target's choice).
Knows nothing about models or drafters.
"""
from __future__ import annotations

import torch

from .sampling import SamplingParams
from .tree import DraftTree


def penalized(params: SamplingParams) -> bool:
    return bool(params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1.0
                or params.logit_bias or params.allowed_token_ids is not None)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int], tree: DraftTree | None = None) -> torch.Tensor:
    """Penalised copy of ``logits [N+1, V]`` over (root, tree nodes...) of one request, or of a
    single row ``[1, V]`` (``tree`` None: the next token after ``output_ids``)."""
    v = logits.shape[-1]
    rows = logits.shape[0]
    if tree is not None and rows != len(tree) + 1:
        raise ValueError(f"{rows} logit rows for a tree of {len(tree)} nodes (expected {len(tree) + 1})")
    out_ids = torch.tensor(output_ids, dtype=torch.long)
    counts = torch.bincount(out_ids, minlength=v)[:v].float().expand(rows, v).clone()
    if tree is not None and len(tree):
        path = tree.ancestor_mask()[:, 1:].float()                      # [N+1, N]: node j on row i's path
        onehot = torch.zeros(len(tree), v).scatter_(1, tree.tokens[:, None], 1.0)
        counts += path @ onehot
    x = logits.float().clone()
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        if prompt_ids:
            seen[:, torch.tensor(prompt_ids, dtype=torch.long)] = True
        rp = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    if params.frequency_penalty:
        x -= params.frequency_penalty * counts
    if params.presence_penalty:
        x -= params.presence_penalty * (counts > 0).float()
    if params.logit_bias:
        ids = _in_vocab(params.logit_bias, v, "logit_bias")
        x[:, ids] += torch.tensor(list(params.logit_bias.values()), dtype=x.dtype)
    if params.allowed_token_ids is not None:
        keep = torch.zeros(v, dtype=torch.bool)
        keep[_in_vocab(params.allowed_token_ids, v, "allowed_token_ids")] = True
        x = x.masked_fill(~keep, float("-inf"))
    return x


def _in_vocab(ids, v: int, what: str) -> torch.Tensor:
    t = torch.tensor(list(ids), dtype=torch.long)
    if int(t.max()) >= v:
        raise ValueError(f"{what} names token {int(t.max())}, outside the vocabulary of {v}")
    return t
