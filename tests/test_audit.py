"""``verispec audit``: passes on shipped drafters, fails on a broken verifier patched in (both
checks can fail), and the CLI writes its JSON report."""
from __future__ import annotations

import json

import pytest

from helpers import BrokenAcceptance
from verispec import LLM, SamplingParams
from verispec.audit import OTHER, _cell_of, _chi_square, audit


@pytest.fixture(scope="module")
def prompts(target):
    tok = target.tokenizer
    texts = ["Count: one, two, three, one, two, three, one,", "My three favourite words are"]
    return [tok(t).input_ids for t in texts]


EAGLE3 = {"method": "eagle3", "topk": 2, "depth": 2, "num_draft_tokens": 3}     # the shipped head


def test_audit_passes_on_a_shipped_drafter(target, prompts):
    """Greedy identity on both prompts; the chi-square on the prompt with the most uncertain
    first token (the counting prompt is nearly deterministic: it would test nothing)."""
    llm = LLM(loaded=target, speculative_config=EAGLE3, max_num_seqs=64)
    rep = audit(llm, prompts, SamplingParams(temperature=1.0, top_p=0.95), max_tokens=12, samples=400, depth=2)
    assert rep.passed, rep.render()
    assert all(c.identical or c.tie for c in rep.greedy) and len(rep.greedy) == 2
    assert rep.sampled[0].prompt == 1 and rep.sampled[0].informative and rep.sampled[0].dof >= 4
    assert "PASS" in rep.render() and json.dumps(rep.as_dict())


@pytest.mark.slow
@pytest.mark.parametrize("spec", [{"method": "eagle"}, {"method": "medusa"}, {"method": "ngram"},
                                  {"method": "draft_model", "model": "self", "self_draft_layers": 8,
                                   "num_speculative_tokens": 3}], ids=lambda s: s["method"])
def test_audit_passes_on_every_shipped_drafter(target, prompts, spec):
    llm = LLM(loaded=target, speculative_config=spec, max_num_seqs=64)
    rep = audit(llm, prompts, SamplingParams(temperature=1.0, top_p=0.95), max_tokens=12, samples=600, depth=2)
    assert rep.passed and rep.sampled[0].informative, rep.render()


def test_audit_fails_on_a_broken_verifier(target, prompts):
    llm = LLM(loaded=target, speculative_config=EAGLE3, max_num_seqs=64)
    llm.acceptance = BrokenAcceptance()          # accepts every first child: sampled output is biased
    rep = audit(llm, prompts[1:], SamplingParams(temperature=1.0, top_p=0.95), max_tokens=12, samples=400, depth=2)
    assert not rep.passed and not rep.sampled[0].passed and rep.sampled[0].p_value < 1e-6, rep.render()
    assert "FAIL" in rep.render()


def test_greedy_difference_that_is_no_tie_fails(target, prompts):
    from verispec.drafting import StatelessDrafter, register
    from verispec.core.tree import DraftTree

    class Wrong(StatelessDrafter):
        max_tree_nodes = 1

        def propose(self, requests):
            return [DraftTree.chain([7]) for _ in requests]
    register("test_audit_wrong", lambda c, t: lambda b, n: Wrong())
    # every step drafts (the draft-budget estimator off): the broken rule must see the drafts
    llm = LLM(loaded=target, speculative_config={"method": "test_audit_wrong", "adaptive_drafting": False})
    llm.acceptance = BrokenAcceptance()
    rep = audit(llm, prompts[:1], SamplingParams(temperature=0.0), max_tokens=8)
    case = rep.greedy[0]
    assert not case.identical and not case.tie and case.top2_margin > 1e-4 and not rep.passed
    assert rep.sampled == []                     # greedy params: the identity check alone


def test_cells_and_pooling():
    kept = {(): {1, 2}, (1,): {5}}
    assert _cell_of((1, 5), kept, 2) == (1, 5) and _cell_of((1, 6), kept, 2) == (1, OTHER)
    assert _cell_of((3, 5), kept, 2) == (OTHER, OTHER) and _cell_of((2, 9), kept, 2) == (2, OTHER)
    exact = {(1, 5): 0.5, (1, OTHER): 0.3, (2, OTHER): 0.199, (OTHER, OTHER): 0.001}
    chi2, dof, _ = _chi_square(exact, {(1, 5): 500, (1, OTHER): 300, (2, OTHER): 199, (OTHER, OTHER): 1}, 1000, 5.0)
    assert chi2 < 1e-6 and dof == 2                         # the 1-expected cell is pooled, not a group alone
    assert _chi_square(exact, {(3, 3): 1}, 1000, 5.0)[0] == float("inf")


def test_cli_audit_writes_the_report(tmp_path):
    from verispec.cli import main
    prompts = tmp_path / "p.txt"
    prompts.write_text("Say a b c a b c a b c\n")
    out = tmp_path / "audit.json"
    code = main(["audit", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--prompts",
                 str(prompts), "--samples", "64", "--depth", "2", "--max-tokens", "8", "--report", str(out)])
    doc = json.loads(out.read_text())
    assert code == (0 if doc["passed"] else 1) and doc["greedy"][0]["identical"] and doc["sampled"][0]["samples"] == 64
    assert main(["audit", "--prompts", str(prompts)]) == 2        # no speculative config: a clear error
