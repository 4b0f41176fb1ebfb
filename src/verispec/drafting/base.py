"""The ``Drafter`` protocol: the only thing the engine knows about a drafter.

Life of a sequence in batch row ``row``:
1. ``start(row, prompt_ids, features)`` after the target prefilled the prompt.
2. Each step: ``propose(requests)`` returns one ``DraftTree`` per request (may be empty).
3. After verification: ``accept(row, committed_ids, features)`` with the tokens whose K/V were
   just committed to the target cache (the previous root plus the accepted draft tokens) and
   the target features at those positions.
4. ``release(row)`` when the sequence ends.

``features`` are ``TargetFeatures`` (hidden states of the layers the drafter asked for in
``hidden_layers``, and the final-normed state when ``needs_last_hidden``), or None.
Device: a drafter returns trees whose tensors (tokens, parents, q) are on the engine's device,
which is the target's (``device.module_device(target.model)``): drafters are built for a loaded
target, their weights and caches on its device.
Drafters never see the verifier, the target cache or the metrics, nor the acceptance rule (the
engine's ``acceptance``) or a request's constraints: the engine prunes a proposed tree to what a
request's grammar allows (``logits.LogitsPipeline.restrict``) before verifying it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..core.features import TargetFeatures
from ..core.sampling import SamplingParams
from ..core.tree import DraftTree


@dataclass
class DraftRequest:
    row: int                        # batch row of the sequence
    context: list[int]              # prompt + generated tokens; context[-1] is the root
    params: SamplingParams
    generator: torch.Generator      # the sequence's RNG (sampled drafts)
    max_nodes: int | None = None    # cap on tree size (e.g. near max_tokens); None = drafter's own


@runtime_checkable
class Drafter(Protocol):
    hidden_layers: tuple[int, ...]
    needs_last_hidden: bool
    max_tree_nodes: int             # upper bound on nodes of any proposed tree

    def start(self, row: int, prompt_ids: list[int], features: TargetFeatures | None) -> None: ...

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]: ...

    def accept(self, row: int, committed_ids: list[int], features: TargetFeatures | None) -> None: ...

    def release(self, row: int) -> None: ...


def tree_on(tree: DraftTree, device: torch.device) -> DraftTree:
    """``tree`` with its tensors on ``device`` (the engine's): drafters that build trees on the
    CPU (n-gram, suffix, static choices) hand them over through this."""
    if tree.tokens.device == device and tree.parents.device == device and \
            (tree.q is None or tree.q.device == device):
        return tree
    return DraftTree(tree.tokens.to(device), tree.parents.to(device), None if tree.q is None else tree.q.to(device))


def tree_from_lists(tokens: list[int], parents: list[int], device: torch.device,
                    q: torch.Tensor | None = None) -> DraftTree:
    """A ``DraftTree`` of plain lists, made on ``device``."""
    return DraftTree(torch.tensor(tokens, dtype=torch.long, device=device),
                     torch.tensor(parents, dtype=torch.long, device=device), q)


class StatelessDrafter:
    """Base for drafters that need no per-row state beyond the context (n-gram, oracles)."""
    hidden_layers: tuple[int, ...] = ()
    needs_last_hidden: bool = False
    max_tree_nodes: int = 0

    def start(self, row, prompt_ids, features) -> None:
        pass

    def accept(self, row, committed_ids, features) -> None:
        pass

    def release(self, row) -> None:
        pass
