"""The format modules (``verispec.formats.eagle3`` / ``eagle1`` / ``medusa``): each writes and reads
back its format exactly, refuses damaged or mismatched checkpoints with a ``CheckpointError`` that
says what is wrong, and is the one reader both the drafters' loader and ``verispec export`` use
(an exported head loaded by the drafter computes what the original head computes)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers import randomise, tiny_head_config, tiny_llama

from verispec.drafting import build_drafter_factory
from verispec.drafting.eagle_head import HeadKind, new_eagle_head
from verispec.drafting.medusa_head import MedusaConfig, MedusaHeads
from verispec.formats import (CheckpointError, MedusaLayout, eagle1, eagle3, medusa, read_config, read_tensors,
                              write_config, write_tensors)
from verispec.models.packed import WeightFormat
from verispec.drafting.spec_config import SpeculativeConfig
from verispec.train.export import export

V, H, L = 24, 32, 8
DRAFT_IDS = torch.tensor([0, 1, 2, 4, 5, 7, 8, 10, 11, 13, 16, 17, 19, 20, 22, 23])

pytestmark = pytest.mark.usefixtures("module_single_thread")


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(V, H, L)


def eagle_head(tiny, kind: HeadKind, **kw):
    head = randomise(new_eagle_head(tiny_head_config(kind, V, H, L, **kw), tiny), seed=1)
    if kind is HeadKind.EAGLE3 and head.cfg.draft_vocab_size < V:
        head.d2t.copy_(DRAFT_IDS - torch.arange(len(DRAFT_IDS)))
        head.t2d.zero_()
        head.t2d[DRAFT_IDS] = True
    return head


def medusa_heads(tiny, layers: int = 1, tied: bool = False) -> MedusaHeads:
    return randomise(MedusaHeads(MedusaConfig(3, layers, H, V, tied_lm_head=tied), tiny.lm_head.weight.detach()), 2)


def identical(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


FORMATS = {  # name -> (module, head maker, save)
    "eagle3": (eagle3, lambda t: eagle_head(t, HeadKind.EAGLE3, draft_vocab_size=len(DRAFT_IDS), fc_norm=True),
               lambda h, p: eagle3.save(h, p)),
    "eagle1": (eagle1, lambda t: eagle_head(t, HeadKind.EAGLE1, fc_bias=True, attention_bias=True),
               lambda h, p: eagle1.save(h, p)),
    "medusa_fd": (medusa, lambda t: medusa_heads(t, layers=2), lambda h, p: medusa.save_medusa_heads(h, p)),
    "medusa_vllm": (medusa, lambda t: medusa_heads(t, tied=True),
                    lambda h, p: medusa.save_medusa_heads(h, p, MedusaLayout.VLLM)),
}


# -- round trips ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FORMATS))
def test_write_then_read_is_identical(tiny, tmp_path, name):
    module, make, save = FORMATS[name]
    head = make(tiny)
    save(head, tmp_path)
    ck = module.read(tmp_path, tiny.cfg)
    assert ck.cfg == head.cfg
    if module is medusa:
        identical(ck.tensors, head.state_dict())
        loaded = medusa.load_medusa_heads(tmp_path, tiny)
    else:
        names = module.tensor_names(head.cfg)
        own = dict(head.named_parameters()) | dict(head.named_buffers())
        identical(ck.tensors, {theirs: own[ours].detach() for theirs, ours in names.items()})
        loaded = module.load(tmp_path, tiny)
    identical(loaded.state_dict(), head.state_dict())
    save(loaded, tmp_path / "again")                             # and writing the loaded head again
    assert read_config(tmp_path / "again") == read_config(tmp_path)
    identical(read_tensors(tmp_path / "again", medusa.FILES), read_tensors(tmp_path, medusa.FILES))


def test_read_without_target_stands_in_from_the_config(tiny, tmp_path):
    eagle3.save(eagle_head(tiny, HeadKind.EAGLE3), tmp_path)
    ck = eagle3.read(tmp_path)
    assert ck.aux_ids_known and ck.cfg.aux_layer_ids == (2, 4, 5) and ck.cfg.target_hidden_size == H
    medusa.save_medusa_heads(medusa_heads(tiny), tmp_path / "m")
    assert medusa.read(tmp_path / "m").cfg == medusa_heads(tiny).cfg


# -- damaged or mismatched checkpoints -------------------------------------------------------------------
def damage(folder, how: str, weights: str, victim: str) -> None:
    cfg, t = read_config(folder), read_tensors(folder, (weights,))
    if how == "hidden":
        cfg["hidden_size"] = H + 8
    elif how == "vocab":
        cfg["vocab_size"] = V + 1
    elif how == "missing":
        del t[victim]
    elif how == "shape":
        t[victim] = torch.zeros(3, 3)
    write_config(folder, cfg)
    write_tensors(folder, t, weights)
    if how == "truncated":
        path = folder / weights
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


CASES = {  # name -> (weights file, a tensor to damage, loader)
    "eagle3": ("model.safetensors", "midlayer.mlp.up_proj.weight", lambda p, t: eagle3.load(p, t)),
    "eagle1": ("model.safetensors", "layers.0.self_attn.q_proj.weight", lambda p, t: eagle1.load(p, t)),
    "medusa_fd": ("medusa_lm_head.safetensors", "1.0.linear.weight", lambda p, t: medusa.load_medusa_heads(p, t)),
    "medusa_vllm": ("model.safetensors", "blocks.2.layers.0.weight", lambda p, t: medusa.load_medusa_heads(p, t)),
}
MESSAGES = {"hidden": r"hidden size|hidden_size 40 differs", "vocab": r"vocab_size 25 differs",
            "missing": r"missing tensors: \['[^']+'\]", "shape": r"checkpoint shape \(3, 3\), config.json implies",
            "truncated": r"cannot read .*(model|medusa_lm_head)\.safetensors"}


@pytest.mark.parametrize("how", list(MESSAGES))
@pytest.mark.parametrize("name", list(CASES))
def test_damaged_checkpoint_is_a_clear_error(tiny, tmp_path, name, how):
    _, make, save = FORMATS[name]
    weights, victim, load = CASES[name]
    save(make(tiny), tmp_path)
    damage(tmp_path, how, weights, victim)
    with pytest.raises(CheckpointError, match=MESSAGES[how]):
        load(tmp_path, tiny)


def test_mismatched_target(tiny, tmp_path):
    """A valid checkpoint for another target: hidden size or vocabulary differ."""
    other = tiny_llama(V + 8, H + 16, L)
    eagle3.save(eagle_head(tiny, HeadKind.EAGLE3), tmp_path / "e3")
    with pytest.raises(CheckpointError, match=f"head vocab_size {V} differs from the target's {V + 8}"):
        eagle3.load(tmp_path / "e3", other)
    medusa.save_medusa_heads(medusa_heads(tiny), tmp_path / "m")
    with pytest.raises(CheckpointError, match=f"Medusa hidden_size {H} differs from the target's {H + 16}"):
        medusa.load_medusa_heads(tmp_path / "m", other)
    with pytest.raises(CheckpointError, match="this is an EAGLE-3 checkpoint"):
        eagle1.load(tmp_path / "e3", tiny)


# -- one reader for the loader and the exporter --------------------------------------------------------
def drafter_of(tmp_path, tiny, method: str, folder):
    """The drafter the engine would build from ``folder`` (the loader path of ``speculative_config``)."""
    config = SpeculativeConfig.from_dict({"method": method, "model": str(folder)})
    target = SimpleNamespace(model=tiny, weights=WeightFormat.DENSE, name="tiny", config=tiny.cfg)
    return build_drafter_factory(config, target)(1, 64)


@pytest.mark.parametrize("kind,fmt", [(HeadKind.EAGLE3, "vllm"), (HeadKind.EAGLE3, "sglang"),
                                      (HeadKind.EAGLE1, "sglang")])
def test_exported_eagle_head_loads_in_the_drafter_unchanged(tiny, tmp_path, kind, fmt):
    head = eagle_head(tiny, kind, **({"draft_vocab_size": len(DRAFT_IDS)} if kind is HeadKind.EAGLE3 else {}))
    (eagle3 if kind is HeadKind.EAGLE3 else eagle1).save(head, tmp_path / "src")
    export(tmp_path / "src", tmp_path / "out", fmt, tiny)
    cfg = read_config(tmp_path / "out")
    if fmt == "sglang" and kind is HeadKind.EAGLE3:          # SGLang's ids are ours minus one: give ours back
        cfg.pop("eagle_config")
        write_config(tmp_path / "out", cfg)
    drafted = drafter_of(tmp_path, tiny, "eagle3" if kind is HeadKind.EAGLE3 else "eagle", tmp_path / "out").head
    g = torch.Generator().manual_seed(0)
    ids, hidden = torch.randint(0, V, (2, 5), generator=g), torch.randn(2, 5, H, generator=g)
    pos = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        want, got = head(ids, pos, hidden), drafted(ids, pos, hidden)
    assert torch.equal(got.hidden, want.hidden) and torch.equal(got.logits, want.logits)
    assert torch.equal(drafted.draft_to_target(torch.arange(head.cfg.draft_vocab_size)),
                       head.draft_to_target(torch.arange(head.cfg.draft_vocab_size)))


def test_exported_medusa_heads_load_in_the_drafter_unchanged(tiny, tmp_path):
    heads = medusa_heads(tiny, tied=True)
    medusa.save_medusa_heads(heads, tmp_path / "src")
    export(tmp_path / "src", tmp_path / "out", "medusa", tiny)            # tied -> one lm_head copy per head
    drafted = drafter_of(tmp_path, tiny, "medusa", tmp_path / "out").heads
    f = torch.randn(3, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(drafted(f), heads(f), rtol=0, atol=1e-6)   # per-head vs batched lm_head matmul


def test_loader_and_exporter_call_the_same_reader(tiny, tmp_path, monkeypatch):
    eagle3.save(eagle_head(tiny, HeadKind.EAGLE3), tmp_path / "src")
    calls = []
    real = eagle3.read
    monkeypatch.setattr(eagle3, "read", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    drafter_of(tmp_path, tiny, "eagle3", tmp_path / "src")
    export(tmp_path / "src", tmp_path / "out", "vllm", tiny)
    assert [str(p) for p in calls] == [str(tmp_path / "src")] * 2
