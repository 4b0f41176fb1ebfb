"""Log-probabilities of emitted tokens, as OpenAI's and vLLM's ``logprobs`` report them.

Contract
- A token's log-probability is taken from the *target's raw* next-token distribution at the
  position it was emitted from: ``log_softmax`` of the target logits in float32, before
  temperature, top-k and top-p (vLLM's default ``raw_logprobs``). So a request's logprobs do not
  depend on its sampling parameters, and a speculative run reports the numbers a vanilla run
  reports for the same tokens (up to float noise between a one-token forward and a verification
  forward; tested).
- The emitting position is the one whose logits the verifier used: the prefill's last position
  for the first token, then the root and the accepted tree nodes of each step, so every emitted
  token (accepted, recovered or bonus) has exactly one entry.
- ``top`` lists the ``k`` most likely tokens, best first, equal log-probabilities by token id.
  ``rank`` is 1 + the number of tokens strictly more likely than the emitted one. ``k = 0``: only
  the emitted token's own entry.
Knows nothing about models, drafters or HTTP.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20           # the most top entries a request may ask for (OpenAI's chat limit)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float | None                   # None: no distribution (a prompt's first token)
    rank: int                               # 1 + the number of strictly more likely tokens (0: None)
    top: tuple[tuple[int, float], ...]      # (token id, logprob), best first, ``k`` entries


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """One entry per row of ``logits [N, V]`` for the emitted ``token_ids`` (length N)."""
    if logits.dim() != 2 or logits.shape[0] != len(token_ids):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(token_ids)} tokens")
    if not 0 <= k <= MAX_LOGPROBS:
        raise ValueError(f"the number of top logprobs must be in [0, {MAX_LOGPROBS}], got {k}")
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    chosen = lp.gather(1, ids[:, None])[:, 0]
    ranks = (lp > chosen[:, None]).sum(-1) + 1
    top_v, top_i = lp.topk(k, dim=-1)                  # then equal values in token-id order
    order = torch.argsort(top_i, dim=-1)
    top_v, top_i = top_v.gather(1, order), top_i.gather(1, order)
    order = torch.argsort(top_v, dim=-1, descending=True, stable=True)
    top_v, top_i = top_v.gather(1, order), top_i.gather(1, order)
    top_i, top_v, chosen, ranks = top_i.tolist(), top_v.tolist(), chosen.tolist(), ranks.tolist()  # one copy each
    return [TokenLogprob(tok, float(chosen[n]), int(ranks[n]), tuple(zip(top_i[n], top_v[n])))
            for n, tok in enumerate(token_ids)]
