"""Greedy speculative output equals vanilla greedy output, token for token.

Drafters: n-gram, a self-draft model (first layers of the target), an oracle (always right) and an
adversarial drafter (never right), with chains and trees, batch 1 and 4. Any mismatch must be a
numerical tie (target top-2 logit margin < 1e-4) and is printed, never silently allowed.
The default run covers 96 tokens at batch 4 on 12 prompts for the n-gram and oracle drafters, 8 for
the self-draft and the adversarial drafter, 4 for the tree self-draft (their steps are full tree
forwards over 4 rows), and 3 prompts at batch 1; the slow marker (``make test-slow``) runs every
drafter on all 20 prompts at batch 1 (plain fp32 target) and batch 4.
The default run uses the fp16-packed target (``models.packed``: the engine logic under test is the
same, its tree forwards cost about a one-token forward); the slow run checks batch 1 on the plain
fp32 target too.
"""
from __future__ import annotations

import pytest
import torch

from helpers import assert_same_or_tie
from verispec import LLM, SamplingParams
from verispec.drafting import StatelessDrafter, register
from verispec.core.tree import DraftTree

MAX_TOKENS = 96
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


class OracleDrafter(StatelessDrafter):
    """Proposes the true greedy continuation (known in advance), as a chain or with wrong siblings."""

    def __init__(self, references: dict[tuple, list[int]], k: int = 5, wrong_siblings: bool = False):
        self.refs, self.k, self.wrong = references, k, wrong_siblings
        self.max_tree_nodes = 2 * k

    def _continuation(self, context: list[int]) -> list[int]:
        for prompt, ref in self.refs.items():
            n = len(prompt)
            if tuple(context[:n]) == prompt:
                done = len(context) - n
                return ref[done:done + self.k]
        raise AssertionError("unknown prompt")

    def propose(self, requests):
        out = []
        for r in requests:
            cont = self._continuation(r.context)[: r.max_nodes if r.max_nodes is not None else self.k]
            toks, pars = [], []
            for i, t in enumerate(cont):
                parent = len(toks) - 1 if i else -1     # the right token of the previous depth
                if self.wrong:                       # a wrong sibling first, then the right token
                    toks.append((t + 1) % 49152), pars.append(parent)
                toks.append(t), pars.append(parent)
            out.append(DraftTree(torch.tensor(toks, dtype=torch.long), torch.tensor(pars, dtype=torch.long)))
        return out


class AdversarialDrafter(OracleDrafter):
    """Never right: every proposed token differs from the greedy continuation."""

    def propose(self, requests):
        out = []
        for r in requests:
            cont = self._continuation(r.context)[: r.max_nodes if r.max_nodes is not None else self.k]
            wrong = [(t + 7) % 49152 for t in cont]
            if len(wrong) > 1:          # a small tree: two wrong children of the root, then a chain
                out.append(DraftTree(torch.tensor([wrong[0], (wrong[0] + 1) % 49152] + wrong[1:]),
                                     torch.tensor([-1, -1] + list(range(0, len(wrong) - 1)))))
            else:
                out.append(DraftTree.chain(wrong))
        return out


@pytest.fixture(scope="module")
def prompts(chat_prompts):
    return chat_prompts[:20]


def _reference(model, prompts):
    outs = LLM(loaded=model, max_num_seqs=4).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return {tuple(p): o.token_ids for p, o in zip(prompts, outs)}


@pytest.fixture(scope="module")
def batch1_prompts(prompts):
    return prompts[::5][:3]          # within the default run's first 12


@pytest.fixture(scope="module")
def reference_all(target, prompts):
    """Vanilla greedy on the fp32 target (slow run)."""
    return _reference(target, prompts)


@pytest.fixture(scope="module")
def packed_reference(packed_target, prompts):
    """Vanilla greedy on the packed target for the prompts of the default run."""
    return _reference(packed_target, prompts[:DEFAULT_PROMPTS])


@pytest.fixture(scope="module")
def packed_reference_all(packed_target, prompts):
    return _reference(packed_target, prompts)


def _llm_with(target, kind, reference, batch):
    if kind == "ngram":
        return LLM(loaded=target, max_num_seqs=batch,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 5, "num_matches": 2})
    if kind == "ngram_extra":
        return LLM(loaded=target, max_num_seqs=batch,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_extra": 1})
    if kind == "self_draft":
        return LLM(loaded=target, max_num_seqs=batch,
                   speculative_config={"method": "draft_model", "model": "self", "self_draft_layers": 8,
                                       "num_speculative_tokens": 3})
    if kind == "self_draft_stop":
        return LLM(loaded=target, max_num_seqs=batch,
                   speculative_config={"method": "draft_model", "model": "self", "self_draft_layers": 8,
                                       "num_speculative_tokens": 5, "draft_confidence_threshold": 0.5})
    if kind == "self_draft_tree":
        return LLM(loaded=target, max_num_seqs=batch,
                   speculative_config={"method": "draft_model", "model": "self", "self_draft_layers": 8,
                                       "tree": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]})
    drafter = {"oracle": OracleDrafter(reference), "oracle_tree": OracleDrafter(reference, wrong_siblings=True),
               "adversarial": AdversarialDrafter(reference)}[kind]
    register(f"test_{kind}", lambda config, tgt: lambda max_batch, max_len: drafter)   # the public registry
    # whole trees every step (the draft-budget estimator off): these drafters test the verifier,
    # and what the estimator would cut depends on this machine's measured costs (test_draft_budget)
    return LLM(loaded=target, max_num_seqs=batch,
               speculative_config={"method": f"test_{kind}", "adaptive_drafting": False})


def _check(target, kind, prompts, reference, batch):
    llm = _llm_with(target, kind, reference, batch)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    ties = []
    for p, o in zip(prompts, outs):
        tie = assert_same_or_tie(target.model, p, o.token_ids, reference[tuple(p)], f"{kind} batch {batch}")
        if tie:
            ties.append(tie)
    return outs, ties


KINDS = ["ngram", "ngram_extra", "self_draft", "self_draft_stop", "self_draft_tree", "oracle", "oracle_tree", "adversarial"]
# Default run: every drafter at batch 4 (20 prompts; the self-drafts and the adversarial drafter on
# 8), batch 1 on 3 prompts. The slow marker runs the rest: every drafter on all 20 at both batches.
DEFAULT_PROMPTS = 12
BATCH4_ONLY = {"self_draft_stop"}       # default run: its ragged per-row stops need a batch; slow: both
DEFAULT_PROMPTS_B4 = {"ngram_extra": 4, "self_draft_stop": 4, "self_draft": 8, "self_draft_tree": 4, "adversarial": 8}


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equal_batch4(packed_target, prompts, packed_reference, kind):
    outs, _ = _check(packed_target, kind, prompts[:DEFAULT_PROMPTS_B4.get(kind, DEFAULT_PROMPTS)],
                     packed_reference, 4)
    mal = sum(o.metrics.num_accepted_tokens for o in outs) / max(1, sum(o.metrics.num_drafts for o in outs))
    if kind.startswith("oracle"):
        assert mal > 3.0, f"oracle should be accepted almost always, got {mal:.2f} accepted per draft"
    if kind == "adversarial":
        assert sum(o.metrics.num_accepted_tokens for o in outs) == 0


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in BATCH4_ONLY])
def test_greedy_equal_batch1(packed_target, batch1_prompts, packed_reference, kind):
    _check(packed_target, kind, batch1_prompts, packed_reference, 1)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equal_batch1_all_prompts(target, prompts, reference_all, kind):
    _check(target, kind, prompts, reference_all, 1)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equal_batch4_all_prompts(packed_target, prompts, packed_reference_all, kind):
    _check(packed_target, kind, prompts, packed_reference_all, 4)
