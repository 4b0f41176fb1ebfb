"""Hybrid drafting (``method: "hybrid"``): per request and step, the suffix tree's draft where the
context repeats, the EAGLE head's where it does not, or none.

Model-free drafting pays where text is copied (code edits, quoting, lists of the prompt's
names) and costs nothing to propose; a learned head pays on new text but costs a draft step. So
each step, for each request, ``SourceChooser`` compares three options by modelled tokens per
millisecond, from this machine's measured step costs (``draft_shape.StepCosts``, the same that
choose the head's shape) and each source's *observed* acceptance on this request:

- suffix: ``(1 + c_s * score) / verify(1 + n)``: ``score`` is arctic's estimate of the draft's
  accepted tokens (the sum of its nodes' path probabilities), ``n`` its nodes;
- head: ``(1 + c_h * E) / (draft + verify(1 + m))``: ``E`` the modelled accepted tokens of the
  head's tree (its acceptance profile), ``draft`` its measured draft cost, ``m`` its nodes;
- plain decoding: ``1 / verify(1)``.

``c_s`` and ``c_h`` calibrate the estimates on the request's own steps: ``(accepted + n0 * e) /
(estimated + n0 * e)`` over the source's last ``window`` drafted steps of that request, shrunk
towards 1 by ``n0 = prior_steps`` steps of the source's typical estimate ``e``; a source that
keeps being rejected stops being chosen (plain decoding then wins), and a copied passage turns
the suffix on at once (its score rises with the match).

Both drafters see every ``start``, ``accept`` and ``release``: the suffix trees learn every
token, and the head keeps its target features; after steps drafted from the suffix the head
catches up on several pairs at once. Lossless: every proposal is a deterministic tree verified
as usual, whichever source drew it; only the speed depends on the choice.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from ..core.tree import DraftTree
from .base import DraftRequest, tree_on
from .draft_shape import StepCosts
from .suffix import SuffixDrafter


@dataclass(frozen=True)
class HeadOption:
    """The head's tree as the chooser sees it: nodes, modelled accepted tokens, draft cost (ms)."""
    nodes: int
    expected_accepted: float
    draft_ms: float


@dataclass
class _Calibration:
    """Observed against estimated accepted tokens of one source's latest drafted steps."""
    steps: deque = field(default_factory=lambda: deque(maxlen=16))

    def factor(self, typical: float, prior_steps: float) -> float:
        n0 = prior_steps * typical
        got = sum(a for a, _ in self.steps) + n0
        est = sum(e for _, e in self.steps) + n0
        return got / est if est > 0 else 1.0


class SourceChooser:
    """Which source drafts a request this step (see the module docstring)."""

    SUFFIX, HEAD, PLAIN = "suffix", "head", "plain"

    def __init__(self, costs: StepCosts, head: HeadOption, prior_steps: float = 2.0, window: int = 16):
        self.costs, self.head, self.prior_steps, self.window = costs, head, prior_steps, window
        self._cal: dict[tuple[int, str], _Calibration] = {}
        self.counts = {self.SUFFIX: 0, self.HEAD: 0, self.PLAIN: 0}

    def _factor(self, row: int, source: str, typical: float) -> float:
        cal = self._cal.get((row, source))
        return 1.0 if cal is None else cal.factor(typical, self.prior_steps)

    def choose(self, row: int, suffix_score: float, suffix_nodes: int) -> str:
        """The source with the most modelled tokens per millisecond for ``row``."""
        c = self.costs
        h = self.head
        value = {self.PLAIN: 1.0 / c.verify_ms(1)}
        if h.nodes > 0:
            value[self.HEAD] = (1.0 + self._factor(row, self.HEAD, h.expected_accepted) * h.expected_accepted) / (
                h.draft_ms + c.verify_ms(1 + h.nodes))
        if suffix_nodes > 0:
            s = self._factor(row, self.SUFFIX, max(suffix_score, 0.5)) * suffix_score
            value[self.SUFFIX] = (1.0 + s) / c.verify_ms(1 + suffix_nodes)
        best = max(value, key=value.get)
        self.counts[best] += 1
        return best

    def observe(self, row: int, source: str, estimated: float, accepted: int) -> None:
        """A step of ``row`` drafted from ``source`` with ``estimated`` accepted tokens got ``accepted``."""
        if source == self.PLAIN:
            return
        cal = self._cal.setdefault((row, source), _Calibration(deque(maxlen=self.window)))
        cal.steps.append((accepted, estimated))

    def release(self, row: int) -> None:
        for source in (self.SUFFIX, self.HEAD):
            self._cal.pop((row, source), None)


class HybridDrafter:
    """A ``Drafter`` over a head drafter (EAGLE) and a ``SuffixDrafter``, one source per request
    and step (``SourceChooser``)."""

    def __init__(self, head, suffix: SuffixDrafter, chooser: SourceChooser, device: str | torch.device = "cpu"):
        self.head, self.suffix, self.chooser = head, suffix, chooser
        self.hidden_layers = tuple(head.hidden_layers)
        self.needs_last_hidden = bool(head.needs_last_hidden)
        self.max_tree_nodes = max(head.max_tree_nodes, suffix.max_tree_nodes)
        self.device = torch.device(device)
        self._last: dict[int, tuple[str, float]] = {}     # row -> (source, estimate) of its last draft

    def start(self, row: int, prompt_ids: list[int], features=None) -> None:
        self.head.start(row, prompt_ids, features)
        self.suffix.start(row, prompt_ids)
        self._last.pop(row, None)

    def accept(self, row: int, committed_ids: list[int], features=None) -> None:
        self.head.accept(row, committed_ids, features)
        self.suffix.accept(row, committed_ids)
        last = self._last.pop(row, None)
        if last is not None:
            self.chooser.observe(row, last[0], last[1], len(committed_ids) - 1)

    def release(self, row: int) -> None:
        self.head.release(row)
        self.suffix.release(row)
        self.chooser.release(row)
        self._last.pop(row, None)

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        trees: list[DraftTree | None] = [None] * len(requests)
        to_head: list[int] = []
        for i, r in enumerate(requests):
            draft = self.suffix.draft(r)
            source = self.chooser.choose(r.row, draft.score, len(draft.tokens))
            if source == SourceChooser.SUFFIX:
                trees[i] = draft.tree(self.device)
                self._last[r.row] = (source, draft.score)
            elif source == SourceChooser.HEAD:
                to_head.append(i)
            else:
                trees[i] = tree_on(DraftTree.empty(), self.device)
                self._last.pop(r.row, None)
        if to_head:
            for i, tree in zip(to_head, self.head.propose([requests[i] for i in to_head])):
                trees[i] = tree
                self._last[requests[i].row] = (SourceChooser.HEAD, self.chooser.head.expected_accepted)
        return trees


def head_option(factory) -> HeadOption:
    """The head's chosen tree (a ``ShapedFactory`` with a shape and its measured costs)."""
    shape, costs = factory.shape, factory.costs
    nodes = len(shape.choices)
    return HeadOption(nodes, shape.expected_tokens - 1.0, max(0.0, shape.step_ms - costs.verify_ms(1 + nodes)))


def build_hybrid_factory(config, target, device, forward=None):
    """The head's factory (``eagle3``, its shape chosen from this machine's measured costs) and one
    ``SuffixCache`` (its global tree shared by every engine); each engine a ``HybridDrafter``.
    ``device``: the target's, where the trees go."""
    from .draft_shape import ShapedFactory
    from .eagle import build_eagle_factory
    from .eagle_head import HeadKind
    from .spec_config import SpecConfigError
    from .suffix import build_suffix_factory
    suffix_factory = build_suffix_factory(config.suffix_config(), device, target)
    head_factory = build_eagle_factory(config.head_config(), target, HeadKind.EAGLE3, forward=forward)
    if head_factory.shape is None or head_factory.costs is None:
        raise SpecConfigError("method 'hybrid' chooses between sources from the head's measured acceptance "
                              "(acceptance.json in its folder) and this machine's step costs: give a head "
                              "with a profile and no tree keys")
    option = head_option(head_factory)

    def make(max_batch: int, max_len: int) -> HybridDrafter:
        chooser = SourceChooser(head_factory.costs, option)
        return HybridDrafter(head_factory(max_batch, max_len), suffix_factory(max_batch, max_len), chooser, device)
    return ShapedFactory(make, head_factory.shape, (), head_factory.costs)
