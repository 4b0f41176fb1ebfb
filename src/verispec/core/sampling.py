"""Sampling: drawing a token from a distribution, per-request generators, and the names the
rest of the package imports (``SamplingParams`` from ``params``, ``target_probs`` from ``logits``).
Knows nothing about models or drafters.
"""
from __future__ import annotations

import torch

from .logits import target_probs
from .params import SamplingParams

__all__ = ["SamplingParams", "target_probs", "sample", "make_generator"]


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a 1-D distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A request's generator on ``device`` (where its distributions live: a CUDA generator draws
    from CUDA tensors), seeded with ``seed``, or from torch's global CPU generator when None. A
    seed gives one stream per device type: the same seed draws other tokens on CPU and CUDA."""
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,), device="cpu")))
    return g
