"""How long drafts get: the n-gram drafter's proposals (longest match first, most recent match
first, the ``prompt_lookup_extra`` cut: after an n-token match at most n + extra tokens, trees of
matches) and the draft model's ``draft_confidence_threshold`` cut of its chains."""
from __future__ import annotations

import pytest

from verispec.drafting.base import DraftRequest
from verispec.drafting.ngram import NgramDrafter
from verispec.core.sampling import SamplingParams


def _propose(drafter, context, max_nodes=None):
    req = DraftRequest(0, context, SamplingParams(temperature=0), None, max_nodes=max_nodes)
    return drafter.propose([req])[0]


def test_longest_and_most_recent_match_wins():
    d = NgramDrafter(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    #            0  1  2  3  4  5  6  7  8  9 10 11
    context = [7, 1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 1, 2, 3]
    # "1 2 3" occurs at 1 and 6: the most recent (6) is followed by 4 5 1
    assert d.continuations(context, 3) == [[4, 5, 1]]
    assert _propose(d, context).tokens.tolist() == [4, 5, 1]
    assert _propose(d, [5, 6, 8]).tokens.tolist() == []            # no match: empty tree


@pytest.mark.parametrize("extra,expect", [(None, [4, 5, 6, 7, 8]), (0, [4, 5, 6]), (1, [4, 5, 6, 7]),
                                          (9, [4, 5, 6, 7, 8])])
def test_extra_cuts_by_match_length(extra, expect):
    d = NgramDrafter(num_speculative_tokens=5, prompt_lookup_min=1, prompt_lookup_max=4, extra=extra)
    context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3]                # "1 2 3": a 3-token match
    assert d.continuations(context, 5) == [expect]
    one = [1, 7, 7, 7, 8, 1]                                         # only "1" matches: n = 1
    d1 = NgramDrafter(num_speculative_tokens=5, prompt_lookup_min=1, prompt_lookup_max=4, extra=extra)
    assert len(d1.continuations(one, 5)[0]) == (5 if extra is None else min(5, 1 + extra))


def test_extra_respects_the_node_budget_and_builds_trees():
    d = NgramDrafter(num_speculative_tokens=5, prompt_lookup_min=1, prompt_lookup_max=2, num_matches=2, extra=1)
    context = [1, 2, 5, 6, 7, 9, 1, 2, 8, 9, 9, 1, 2]                # "1 2" at 0 and 6
    tree = _propose(d, context)
    assert sorted(map(tuple, [tree.tokens.tolist()])) == [(8, 9, 9, 5, 6, 7)]
    assert tree.parents.tolist() == [-1, 0, 1, -1, 3, 4]
    assert len(_propose(d, context, max_nodes=2)) == 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="extra"):
        NgramDrafter(extra=-1)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramDrafter(prompt_lookup_min=3, prompt_lookup_max=2)


def test_draft_confidence_threshold_cuts_chains(single_thread):
    """A draft-model chain ends after a token the draft gave less than the threshold; a tiny
    threshold keeps every chain at full length; rows of one batch stop independently."""
    import torch
    from helpers import tiny_llama
    from verispec.drafting.draft_model import DraftModelDrafter
    model = tiny_llama(32, 16, 2)
    reqs = [DraftRequest(r, [1, 2, 3, 4 + r], SamplingParams(temperature=0), None) for r in range(3)]
    full = DraftModelDrafter(model, max_batch=3, max_len=32, num_speculative_tokens=4, confidence_threshold=1e-9)
    assert [len(t) for t in full.propose(reqs)] == [4, 4, 4]
    strict = DraftModelDrafter(model, max_batch=3, max_len=32, num_speculative_tokens=4, confidence_threshold=0.999)
    assert [len(t) for t in strict.propose(reqs)] == [1, 1, 1]     # a random tiny model is never that sure
    torch.manual_seed(0)
    probs = []
    for r, tree in zip(reqs, full.propose(reqs)):                  # the probabilities along each chain
        ctx, ps = list(r.context), []
        for tok in tree.tokens.tolist():
            logits = model(torch.tensor([ctx]), torch.arange(len(ctx))[None]).logits[0, -1]
            ps.append(float(torch.softmax(logits, -1)[tok]))
            ctx.append(tok)
        probs.append(ps)
    flat = sorted(p for ps in probs for p in ps)
    cut = (flat[5] + flat[6]) / 2                                   # between two chain probabilities
    mid = DraftModelDrafter(model, max_batch=3, max_len=32, num_speculative_tokens=4, confidence_threshold=cut)
    expect = [next((i + 1 for i, p in enumerate(ps) if p < cut), 4) for ps in probs]
    assert [len(t) for t in mid.propose(reqs)] == expect and len(set(expect)) > 1, expect
    with pytest.raises(ValueError, match="confidence_threshold"):
        DraftModelDrafter(model, max_batch=1, max_len=8, confidence_threshold=1.0)
