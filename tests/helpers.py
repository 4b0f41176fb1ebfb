"""Test helpers: greedy comparison that reports numerical ties instead of hiding them."""
from __future__ import annotations

import torch

TIE_MARGIN = 1e-4


def top2_margin(model, ids: list[int]) -> float:
    """Target top-2 logit margin for the next token after ``ids`` (plain full forward)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None]).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def assert_same_or_tie(model, prompt: list[int], got: list[int], want: list[int], label: str = "") -> str | None:
    """Equal token for token, or the first difference is a numerical tie (reported, returned)."""
    n = min(len(got), len(want))
    diff = next((i for i in range(n) if got[i] != want[i]), None)
    if diff is None:
        assert len(got) == len(want), f"{label}: lengths differ {len(got)} vs {len(want)} with equal prefix"
        return None
    margin = top2_margin(model, prompt + want[:diff])
    msg = f"{label}: first difference at token {diff} (got {got[diff]}, want {want[diff]}), top-2 margin {margin:.2e}"
    assert margin < TIE_MARGIN, "not a numerical tie: " + msg
    print("numerical tie reported:", msg)
    return msg
