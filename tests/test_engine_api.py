"""The engine's edges: the acceptance slot is a typed constructor argument, admission is all or
nothing, and no module outside the engine edits its fields (the scheduler asks it)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from helpers import tiny_llama
from verispec.core.acceptance import LOSSLESS, AcceptanceRule, LosslessAcceptance, LossyTypicalAcceptance
from verispec.drafting import StatelessDrafter
from verispec.core.engine import Engine, Sequence
from verispec.core.params import SamplingParams
from verispec.core.tree import DraftTree

SRC = Path(__file__).resolve().parents[1] / "src" / "verispec"
ENGINE_FIELDS = {"free_rows", "cache", "running", "prefilling", "_drafter", "acceptance", "stats", "eos", "max_context", "model"}


class _Chain(StatelessDrafter):
    max_tree_nodes = 2

    def __init__(self, fail_start_on_row: int | None = None):
        self.fail_start_on_row, self.started, self.released = fail_start_on_row, [], []

    def start(self, row, prompt_ids, features):
        if row == self.fail_start_on_row:
            raise RuntimeError("drafter start failed")
        self.started.append(row)

    def release(self, row):
        self.released.append(row)

    def propose(self, requests):
        return [DraftTree.chain([1, 2]) for _ in requests]


def test_acceptance_slot_is_typed_and_reported(single_thread):
    assert isinstance(LOSSLESS, AcceptanceRule) and isinstance(LossyTypicalAcceptance(), AcceptanceRule)
    assert LosslessAcceptance().lossy is False and LossyTypicalAcceptance().lossy is True
    assert "lossy" in LossyTypicalAcceptance.name
    with pytest.raises(TypeError, match="AcceptanceRule"):
        Engine(tiny_llama(10, 16, 2), None, max_batch=1, max_len=16, acceptance=lambda *a: None)
    calls = []

    class Counting:
        name, lossy = "counting", False

        def __call__(self, tree, logits, params, g):
            calls.append(len(tree))
            return LOSSLESS(tree, logits, params, g)
    eng = Engine(tiny_llama(10, 16, 2), _Chain(), max_batch=1, max_len=32, acceptance=Counting())
    seq = Sequence([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    eng.run([seq])
    assert calls[:2] == [2, 2] and max(calls) == 2              # trees are cut near max_tokens
    assert seq.stats.acceptance == "counting" and eng.stats.acceptance == "counting"


def test_failed_admission_takes_no_row(single_thread):
    """A batch whose drafter fails to start one sequence admits none of them: rows, cache and
    drafter state are given back, and the engine serves the next request."""
    drafter = _Chain(fail_start_on_row=1)
    eng = Engine(tiny_llama(10, 16, 2), drafter, max_batch=3, max_len=32)
    seqs = [Sequence([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4)) for _ in range(2)]
    with pytest.raises(RuntimeError, match="drafter start failed"):
        eng.add_many(seqs)
    assert sorted(eng.free_rows) == [0, 1, 2] and eng.num_running == 0 and all(s.row == -1 for s in seqs)
    assert drafter.started == [0] and 0 in drafter.released          # partial drafter state released too
    assert int(eng.cache.lengths.sum()) == 0
    drafter.fail_start_on_row = None
    out = eng.run([Sequence([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))])
    assert len(out[0].output_ids) == 4


def _engine_field_edits(path: Path) -> list[str]:
    """``x.engine.f = ...``, ``eng.f.append(...)`` and the like: engine fields touched from outside."""
    bad = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and _is_engine(t.value):
                bad.append(f"{path.name}:{node.lineno} assigns engine.{t.attr}")
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_FIELDS - {"stats", "acceptance", "model"} \
                and _is_engine(node.value):
            bad.append(f"{path.name}:{node.lineno} reads engine.{node.attr}")
    return bad


def _is_engine(node: ast.AST) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name in ("engine", "eng", "_engine")


def test_nothing_outside_the_engine_touches_its_fields():
    bad = [b for p in sorted(SRC.rglob("*.py")) if p.name != "engine.py" for b in _engine_field_edits(p)]
    assert not bad, bad
    probe = SRC.parent.parent / "tests" / "_probe_engine_edit.py"
    try:                                        # the check itself can fail
        probe.write_text("def f(self):\n    self.engine.free_rows.append(0)\n    eng.drafter = None\n")
        assert len(_engine_field_edits(probe)) == 2
    finally:
        probe.unlink()
    torch.manual_seed(0)
