"""Draft shapes from measured costs (``verispec.drafting.draft_shape``): the profile, the cost model, the
best tree, the cost cache, and the default EAGLE-3 config choosing its tree on the real head."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import assert_same_or_tie

from verispec import LLM, SamplingParams
from verispec.drafting.draft_shape import (AcceptanceProfile, StepCosts, best_paths, best_tree, cached_costs,
                                  tree_cost)
from verispec.drafting.batch_cost import interpolate as _interpolate
from verispec.core.tree import validate_choices

ROOT = Path(__file__).resolve().parents[1] / "checkpoints"


def profile(rows):
    return AcceptanceProfile(tuple(tuple(r) for r in rows))


def test_profile_from_hits_differences_and_validates(tmp_path):
    p = AcceptanceProfile.from_hits([[0.5, 0.7, 0.65, 0.8]], "x")          # a dip in cumulative hits is flattened
    assert p.rank_probs[0] == pytest.approx((0.5, 0.2, 0.0, 0.1))
    assert p.p(1, 1) == pytest.approx(0.2) and p.p(2, 0) == 0.0 and p.p(1, 9) == 0.0
    with pytest.raises(ValueError, match="sum to at most 1"):
        profile([[0.8, 0.5]])
    with pytest.raises(ValueError, match="at least one depth"):
        profile([])
    p.save(tmp_path)
    assert AcceptanceProfile.load(tmp_path).rank_probs == p.rank_probs
    (tmp_path / "acceptance.json").write_text("{not json")
    with pytest.raises(ValueError, match="not an acceptance profile"):
        AcceptanceProfile.load(tmp_path)
    assert AcceptanceProfile.load(tmp_path / "none") is None


def test_best_paths_are_connected_and_in_value_order():
    p = profile([[0.6, 0.2, 0.1], [0.5, 0.2], [0.4, 0.1]])
    paths = best_paths(p, 50, max_depth=3, max_width=3)
    values = [v for _, v in paths]
    assert values == sorted(values, reverse=True)
    for m in range(1, len(paths) + 1):
        validate_choices([c for c, _ in paths[:m]])                      # every prefix is a choices tree
    # exact values: (0,) 0.6, (0,0) 0.3, (1,) 0.2, (0,0,0) 0.12, (0,1) 0.12
    assert paths[0] == ((0,), pytest.approx(0.6)) and paths[1] == ((0, 0), pytest.approx(0.3))
    assert dict(paths)[(0, 0, 0)] == pytest.approx(0.12) and dict(paths)[(1, 0)] == pytest.approx(0.1)
    assert len(paths) == 3 * 2 * 2 + 3 * 2 + 3                                # every non-zero path, no more


def test_cost_model_counts_levels_and_verify_tokens():
    costs = StepCosts(verify=((1, 20.0), (5, 24.0)), draft_fixed=2.0, level=((1, 1.0), (2, 1.5)))
    chain = ((0,), (0, 0), (0, 0, 0))
    assert tree_cost(chain, costs) == pytest.approx(2.0 + 1.0 + 1.0 + 23.0)     # 2 levels of one node, verify(4)
    tree = ((0,), (1,), (0, 0), (1, 0))
    assert tree_cost(tree, costs) == pytest.approx(2.0 + 1.5 + 24.0)            # one level of two nodes, verify(5)
    medusa = StepCosts(verify=((1, 20.0), (5, 24.0)), draft_fixed=3.0)
    assert tree_cost(chain, medusa) == pytest.approx(3.0 + 23.0)                # no per-level cost


def test_monotone_fit_pools_noise():
    pts = ((1, 20.0), (2, 30.0), (3, 22.0), (4, 22.0), (8, 40.0))
    assert _interpolate(pts, 1) == 20.0
    assert _interpolate(pts, 2) == pytest.approx(_interpolate(pts, 4)) == pytest.approx(74 / 3)
    assert _interpolate(pts, 6) == pytest.approx(74 / 3 + (40 - 74 / 3) / 2)
    assert _interpolate(pts, 16) > 40.0                                          # extended with the last slope


def test_best_tree_follows_costs_and_acceptance():
    good = profile([[0.8, 0.1], [0.8, 0.1], [0.8, 0.1], [0.8, 0.1], [0.8, 0.1], [0.8, 0.1]])
    flat = StepCosts(verify=((1, 20.0), (32, 21.0)), draft_fixed=0.5, level=((1, 0.5), (8, 0.6)))
    steep = StepCosts(verify=((1, 20.0), (2, 40.0), (32, 640.0)), draft_fixed=0.5, level=((1, 0.5),))
    costly_levels = StepCosts(verify=((1, 20.0), (32, 21.0)), draft_fixed=0.5, level=((1, 15.0), (8, 16.0)))
    wide = best_tree(good, flat)
    assert wide.depth == 6 and len(wide.choices) > 6 and wide.speedup > 2.5
    assert best_tree(good, steep).choices == ((0,),)                 # each verified token costs half a forward
    shallow = best_tree(good, costly_levels)
    assert shallow.depth == 1 and shallow.topk == 2                  # no level pays, the root's two best do
    weak = best_tree(profile([[0.05, 0.01]]), flat)
    assert weak.speedup < 1.1 and weak.expected_tokens == pytest.approx(1 + sum(
        v for _, v in best_paths(profile([[0.05, 0.01]]), len(weak.choices), 8, 8)))
    assert "modelled" in wide.describe() and wide.as_dict()["num_nodes"] == len(wide.choices)


def test_cost_cache_round_trip(tmp_path, monkeypatch, measured_costs):
    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path / "costs.json"))
    calls = []

    def measure():
        calls.append(1)
        return StepCosts(((1, 20.0), (4, 21.0)), 2.0, ((1, 1.0),), "test")
    a = cached_costs("k", measure)
    b = cached_costs("k", measure)
    assert a == b and len(calls) == 1
    (tmp_path / "costs.json").write_text("{broken")
    assert cached_costs("k", measure) == a and len(calls) == 2               # a broken cache is remeasured
    assert "k" in json.loads((tmp_path / "costs.json").read_text())


def test_a_shape_that_does_not_pay_is_reported(tmp_path, monkeypatch, caplog):
    """A weak head on steep costs: the best shape is modelled below 1x; describe() and a
    warning from choose_shape say so (a strong head on the same costs does not warn)."""
    import torch.nn as nn

    import verispec.drafting.draft_shape as ds
    steep = StepCosts(verify=((1, 20.0), (2, 30.0), (8, 90.0)), draft_fixed=3.0, level=((1, 3.0),))
    monkeypatch.setattr(ds, "cached_costs", lambda key, measure: steep)
    target = type("T", (), {"model": nn.Linear(2, 2), "name": "stub", "weights": "fp16"})()
    weak = AcceptanceProfile.from_hits([[0.1], [0.1]])
    with caplog.at_level("WARNING", logger="verispec"):
        shape = ds.choose_shape(target, tmp_path, "eagle3", ds.ShapeRequest(weak, lambda: None, max_depth=2))
    assert not shape.pays and shape.speedup < 1.0
    assert "no shape pays" in shape.describe() and "no shape pays" in caplog.text
    caplog.clear()
    strong = AcceptanceProfile.from_hits([[0.9], [0.9]])
    with caplog.at_level("WARNING", logger="verispec"):
        shape = ds.choose_shape(target, tmp_path, "eagle3", ds.ShapeRequest(strong, lambda: None, max_depth=2))
    assert shape.pays and "no shape pays" not in shape.describe() and not caplog.text


@pytest.fixture(scope="module")
def profiled_head(tmp_path_factory):
    folder = tmp_path_factory.mktemp("head") / "eagle3"
    shutil.copytree(ROOT / "smollm2-135m-eagle3", folder)
    AcceptanceProfile.from_hits([[0.45, 0.55, 0.6], [0.35, 0.45, 0.5], [0.3, 0.4], [0.25]]).save(folder)
    return folder


def test_default_config_chooses_its_tree_and_stays_lossless(packed_target, chat_prompts, profiled_head,
                                                           tmp_path, monkeypatch, measured_costs):
    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path / "costs.json"))
    spec = LLM(loaded=packed_target, speculative_config={"method": "eagle3", "model": str(profiled_head)})
    shape = spec.draft_shape
    assert shape is not None and 1 <= len(shape.choices) <= 32 and shape.depth <= 4
    assert len(json.loads((tmp_path / "costs.json").read_text())) == 1          # measured once, cached
    engine = spec.make_engine(1, 256)
    assert engine.drafter.tree.choices == shape.choices
    llm = LLM(loaded=packed_target)
    params = SamplingParams(temperature=0, max_tokens=32)
    prompts = [{"prompt_token_ids": ids} for ids in chat_prompts[:2]]
    for p, o, r in zip(prompts, spec.generate(prompts, params), llm.generate(prompts, params)):
        assert_same_or_tie(llm.target.model, p["prompt_token_ids"], o.token_ids, r.token_ids, "eagle3 shaped")
    # a shape key, or no profile, keeps the user's / the default tree
    chain = LLM(loaded=packed_target, speculative_config={"method": "eagle3", "model": str(profiled_head),
                                                         "num_speculative_tokens": 2})
    assert chain.draft_shape is None


def test_verify_costs_are_measured_on_the_forward_the_engine_runs():
    """A compiled target's fixed cost per call is lower than the eager one's: the shape is chosen
    from the forward the engines run (``forward``), and the cost cache keeps the two apart."""
    from helpers import tiny_llama

    import verispec.drafting.draft_shape as ds
    model = tiny_llama(48, 32, 1, seed=5)
    seen = []

    def forward(tokens, positions, cache, **kw):
        seen.append((tokens.shape[1], kw["rows"], kw["kv_len"]))
        return model(tokens, positions, cache, **kw)
    points = ds.measure_verify(model, points=(1, 3), context=16, reps=2, forward=forward)
    assert [t for t, _ in points] == [1, 3] and all(ms > 0 for _, ms in points)
    assert {t for t, _, _ in seen} == {1, 3} and all(rows == [0] for _, rows, _ in seen)
    target = type("T", (), {"model": model, "name": "tiny", "weights": "dense"})()
    assert ds.cost_key(target, ROOT / "smollm2-135m-eagle3", "eagle3", compiled=True) != \
        ds.cost_key(target, ROOT / "smollm2-135m-eagle3", "eagle3")


def test_chains_are_costed_at_the_chain_programs_costs():
    """A head with a chain program (``StepCosts.chain``) drafts chains through it and trees on the
    tree path: each shape is costed on the path it runs, and a tree's prefixes stay on its path."""
    from verispec.drafting.draft_shape import gate_options, tree_cost
    costs = StepCosts(verify=((1, 10.0), (4, 13.0)), draft_fixed=2.0, level=((1, 1.0), (2, 1.5)), chain=(0.5, 0.2))
    assert tree_cost(((0,), (0, 0), (0, 0, 0)), costs) == pytest.approx(0.5 + 2 * 0.2 + 13.0)
    assert tree_cost(((0,), (1,), (0, 0)), costs) == pytest.approx(2.0 + 1.0 + 13.0)
    p = AcceptanceProfile(((0.5, 0.2), (0.4,)))
    first = gate_options([[0], [1], [0, 0]], p, costs)[0]            # [[0]] cut from a tree: tree path
    assert first.cost_ratio == pytest.approx((2.0 + costs.verify_ms(2)) / 10.0)
    chain = gate_options([[0], [0, 0]], p, costs)[0]
    assert chain.cost_ratio == pytest.approx((0.5 + costs.verify_ms(2)) / 10.0)
