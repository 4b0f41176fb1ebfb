"""Export: every (source kind, format) pair writes the file and tensor names its consumer loads
(SGLang / vLLM / EAGLE repo / FasterDecoding), the export reads back with our loaders to the same
tensors, and each format a head cannot be expressed in is refused with the reason."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from helpers import tiny_llama

from verispec.formats import (CheckpointError, MedusaLayout, load_eagle_head, load_medusa_heads,
                                  new_eagle_head, read_tensors, save_eagle_head, save_medusa_heads,
                                  write_tensors)
from verispec.drafting.eagle_head import EagleHeadConfig, HeadKind, init_head_weights
from verispec.drafting.medusa_head import MedusaConfig, MedusaHeads
from verispec.train.export import (ExportFormat, ExportWarning, SourceKind, detect_source, export,
                                   export_checkpoint)

V, H, L = 24, 32, 8            # tiny target: EAGLE's fixed aux layers (2, 4, 5) are distinct
DRAFT_IDS = torch.tensor([0, 1, 2, 4, 5, 7, 8, 10, 11, 13, 16, 17, 19, 20, 22, 23])
EAGLE3_NAMES = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
    f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm",
                                     "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
EAGLE1_NAMES = {"fc.weight"} | {
    f"layers.0.{n}.weight" for n in ("post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                                     "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                     "mlp.down_proj")}


pytestmark = pytest.mark.usefixtures("module_single_thread")   # tiny models: one thread


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(V, H, L)


def eagle_head(tiny, kind: HeadKind, **kw):
    base = dict(kind=kind, hidden_size=H, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8,
                vocab_size=V, draft_vocab_size=V, target_hidden_size=H, target_num_layers=L,
                aux_layer_ids=EagleHeadConfig.default_aux_layer_ids(L) if kind is HeadKind.EAGLE3 else ())
    head = init_head_weights(new_eagle_head(EagleHeadConfig(**(base | kw)), tiny), seed=1, std=0.3)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif p.dim() == 1:
                p.normal_(0, 0.3)                       # non-zero biases
    if kind is HeadKind.EAGLE3 and head.cfg.draft_vocab_size < V:
        head.d2t.copy_(DRAFT_IDS - torch.arange(len(DRAFT_IDS)))
        head.t2d.zero_()
        head.t2d[DRAFT_IDS] = True
    return head


def medusa(tiny, tied: bool, layers: int = 1, bias: bool = True) -> MedusaHeads:
    m = MedusaHeads(MedusaConfig(3, layers, H, V, tied_lm_head=tied, block_bias=bias), tiny.lm_head.weight.detach())
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m.eval()


def cfg_of(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def same_tensors(a: dict, b: dict, skip: set = frozenset()) -> None:
    assert set(a) - skip == set(b) - skip
    for k in set(a) - skip:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def files(folder) -> set[str]:
    return {p.name for p in folder.iterdir()}


# -- EAGLE-3 -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["sglang", "vllm", "eagle"])
def test_eagle3(tiny, tmp_path, fmt):
    head = eagle_head(tiny, HeadKind.EAGLE3, draft_vocab_size=len(DRAFT_IDS))
    save_eagle_head(head, tmp_path / "src")
    assert detect_source(tmp_path / "src") is SourceKind.EAGLE3
    rep = export(tmp_path / "src", tmp_path / "out", fmt, tiny)
    out, cfg = tmp_path / "out", cfg_of(tmp_path / "out")
    weights = "pytorch_model.bin" if fmt == "eagle" else "model.safetensors"
    assert files(out) == {"config.json", weights} and [f for f, _ in rep.files] == [weights, "config.json"]
    names = set(read_tensors(out, (weights,)))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == len(DRAFT_IDS) and cfg["tie_word_embeddings"] is False
    assert cfg["torch_dtype"] == "float32" and cfg["vocab_size"] == V
    ids = [2, 4, 5]
    if fmt == "sglang":          # SGLang adds 1: an id names the layer whose output is fused
        assert names == EAGLE3_NAMES and rep.tensors == len(EAGLE3_NAMES)
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
        assert cfg["target_hidden_size"] == H and "eagle_aux_hidden_state_layer_ids" not in cfg
        loaded = load_eagle_head(out, tiny, HeadKind.EAGLE3, aux_layer_ids=(2, 4, 5))
        assert loaded.cfg == head.cfg
    elif fmt == "vllm":
        assert names == EAGLE3_NAMES
        assert cfg["eagle_aux_hidden_state_layer_ids"] == ids == cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        assert cfg["target_hidden_size"] == H
        loaded = load_eagle_head(out, tiny, HeadKind.EAGLE3)
        assert loaded.cfg == head.cfg
    else:                        # EAGLE repo: self-contained, EConfig keys, base embedding from the head
        assert names == EAGLE3_NAMES | {"embed_tokens.weight"}
        assert "target_hidden_size" not in cfg and cfg["bias"] is False and cfg["pretraining_tp"] == 1
        assert cfg["rope_scaling"] is None
        loaded = load_eagle_head(out, tiny, HeadKind.EAGLE3)
        assert loaded.cfg == replace(head.cfg, own_embedding=True)
        assert torch.equal(loaded.embed_tokens, tiny.embed.weight)
        assert any("embed_tokens" in n for n in rep.notes)
    same_tensors(head.state_dict(), loaded.state_dict(), skip={"embed_tokens"})


def test_eagle3_bf16_stays_bf16(tiny, tmp_path):
    head = eagle_head(tiny, HeadKind.EAGLE3).to(torch.bfloat16)
    save_eagle_head(head, tmp_path / "src")
    for fmt in ("vllm", "eagle"):
        export(tmp_path / "src", tmp_path / fmt, fmt)          # no target needed
        got = read_tensors(tmp_path / fmt)
        want = read_tensors(tmp_path / "src")
        same_tensors(want, got)
        assert got["fc.weight"].dtype == torch.bfloat16 and cfg_of(tmp_path / fmt)["torch_dtype"] == "bfloat16"


def test_eagle3_custom_aux_layers(tiny, tmp_path):
    head = eagle_head(tiny, HeadKind.EAGLE3, aux_layer_ids=(1, 4, 8))
    save_eagle_head(head, tmp_path / "src")
    export(tmp_path / "src", tmp_path / "sg", "sglang", tiny)
    assert cfg_of(tmp_path / "sg")["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 7]
    export(tmp_path / "src", tmp_path / "vl", "vllm", tiny)
    assert load_eagle_head(tmp_path / "vl", tiny, HeadKind.EAGLE3).cfg.aux_layer_ids == (1, 4, 8)
    with pytest.raises(CheckpointError, match=r"always fuses the inputs of target layers \[2, 4, 5\]"):
        export(tmp_path / "src", tmp_path / "ea", "eagle", tiny)
    assert not (tmp_path / "ea").exists()                      # nothing written on refusal


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "eagle"])
def test_eagle31_refused(tiny, tmp_path, fmt):
    save_eagle_head(eagle_head(tiny, HeadKind.EAGLE3, fc_norm=True, norm_output=True), tmp_path / "src")
    with pytest.raises(CheckpointError, match="EAGLE-3.1 switches fc_norm=True / norm_output=True"):
        export(tmp_path / "src", tmp_path / "out", fmt, tiny)


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "eagle"])
def test_norm_before_residual_only_where_read(tiny, tmp_path, fmt):
    """vLLM reads speculators' ``norm_before_residual``; SGLang and the EAGLE repo would run the
    head as plain EAGLE-3 (wrong drafts), so those exports are refused."""
    save_eagle_head(eagle_head(tiny, HeadKind.EAGLE3, norm_before_residual=True), tmp_path / "src")
    if fmt == "vllm":
        export(tmp_path / "src", tmp_path / "out", fmt, tiny)
        assert cfg_of(tmp_path / "out")["norm_before_residual"] is True
        assert load_eagle_head(tmp_path / "out", tiny, HeadKind.EAGLE3).cfg.norm_before_residual
        return
    with pytest.raises(CheckpointError, match="norm_before_residual"):
        export(tmp_path / "src", tmp_path / "out", fmt, tiny)


def test_own_embedding_replaced_by_consumer_is_refused(tiny, tmp_path):
    save_eagle_head(eagle_head(tiny, HeadKind.EAGLE3, own_embedding=True), tmp_path / "src")
    with pytest.raises(CheckpointError, match="differs from the target's"):
        export(tmp_path / "src", tmp_path / "out", "vllm", tiny)
    with pytest.raises(CheckpointError, match="pass the target model"):
        export(tmp_path / "src", tmp_path / "out", "sglang")
    export(tmp_path / "src", tmp_path / "ea", "eagle", tiny)   # the EAGLE repo reads the head's own
    assert "embed_tokens.weight" in read_tensors(tmp_path / "ea")


# -- EAGLE-1 -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,fc_bias", [("eagle", True), ("sglang", False), ("vllm", False)])
def test_eagle1(tiny, tmp_path, fmt, fc_bias):
    head = eagle_head(tiny, HeadKind.EAGLE1, fc_bias=fc_bias)
    save_eagle_head(head, tmp_path / "src")
    assert detect_source(tmp_path / "src") is SourceKind.EAGLE1
    rep = export(tmp_path / "src", tmp_path / "out", fmt, tiny)
    out, cfg = tmp_path / "out", cfg_of(tmp_path / "out")
    weights = "pytorch_model.bin" if fmt == "eagle" else "model.safetensors"
    assert files(out) == {"config.json", weights}
    names = set(read_tensors(out, (weights,)))
    loaded = load_eagle_head(out, tiny, HeadKind.EAGLE1)
    if fmt == "eagle":
        assert names == EAGLE1_NAMES | {"fc.bias", "embed_tokens.weight"}
        assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["bias"] is True and cfg["pretraining_tp"] == 1
        assert loaded.cfg == replace(head.cfg, own_embedding=True)
    elif fmt == "sglang":        # SGLang's fc always has a bias: zeros, same function
        assert names == EAGLE1_NAMES | {"fc.bias"} and cfg["architectures"] == ["LlamaForCausalLMEagle"]
        assert cfg["bias"] is False                   # SGLang reads `bias` as attention bias
        assert torch.equal(loaded.fc.bias, torch.zeros(H)) and loaded.cfg == replace(head.cfg, fc_bias=True)
        assert any("fc.bias = 0" in n for n in rep.notes)
    else:                        # vLLM maps LlamaForCausalLM to EagleLlamaForCausalLM
        assert names == EAGLE1_NAMES and cfg["architectures"] == ["LlamaForCausalLM"] and cfg["bias"] is False
        assert loaded.cfg == head.cfg
    same_tensors(head.state_dict(), loaded.state_dict(), skip={"fc.bias", "embed_tokens"})
    if fc_bias:
        assert torch.equal(head.fc.bias, loaded.fc.bias)


def test_eagle1_fc_bias_not_for_vllm(tiny, tmp_path):
    save_eagle_head(eagle_head(tiny, HeadKind.EAGLE1, fc_bias=True), tmp_path / "src")
    with pytest.raises(CheckpointError, match="vLLM's EAGLE-1 fc has no bias"):
        export(tmp_path / "src", tmp_path / "out", "vllm", tiny)


# -- Medusa --------------------------------------------------------------------------------------------
def fd_names(heads: int, layers: int) -> set[str]:
    return {f"{i}.{j}.linear.{k}" for i in range(heads) for j in range(layers) for k in ("weight", "bias")} \
        | {f"{i}.{layers}.weight" for i in range(heads)}


@pytest.mark.parametrize("layout", list(MedusaLayout))
@pytest.mark.parametrize("fmt", ["medusa", "vllm"])
def test_medusa_untied(tiny, tmp_path, fmt, layout):
    heads = medusa(tiny, tied=False, layers=2)
    save_medusa_heads(heads, tmp_path / "src", layout)
    assert detect_source(tmp_path / "src") is SourceKind.MEDUSA
    rep = export(tmp_path / "src", tmp_path / "out", fmt, base_model_name_or_path="org/target")
    out, cfg = tmp_path / "out", cfg_of(tmp_path / "out")
    if fmt == "medusa":
        assert files(out) == {"config.json", "medusa_lm_head.safetensors", "medusa_lm_head.pt"}
        for weights in ("medusa_lm_head.safetensors", "medusa_lm_head.pt"):     # MedusaModel reads the .pt
            same_tensors(read_tensors(out, ("medusa_lm_head.safetensors",)), read_tensors(out, (weights,)))
        assert set(read_tensors(out, ("medusa_lm_head.safetensors",))) == fd_names(3, 2)
        assert [f for f, _ in rep.files] == ["medusa_lm_head.safetensors", "medusa_lm_head.pt", "config.json"]
        assert cfg["medusa_num_heads"] == 3 and cfg["medusa_num_layers"] == 2
        assert cfg["base_model_name_or_path"] == "org/target" and cfg["tie_lm_head"] is False
        assert any("[ResBlock] * medusa_num_layers" in n for n in rep.notes)
    else:
        assert files(out) == {"config.json", "model.safetensors"}
        assert set(read_tensors(out)) == set(heads.state_dict())
        assert cfg["architectures"] == ["MedusaModel"] and cfg["model_type"] == "medusa"
        assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["medusa_fc_bias"]) == (3, 2, True)
        assert cfg["truncated_vocab_size"] == V and "original_lm_head" not in cfg
    loaded = load_medusa_heads(out, tiny)
    assert loaded.cfg == heads.cfg
    same_tensors(heads.state_dict(), loaded.state_dict())


def test_medusa_tied_to_faster_decoding(tiny, tmp_path):
    heads = medusa(tiny, tied=True, bias=False)
    save_medusa_heads(heads, tmp_path / "src")
    with pytest.raises(CheckpointError, match="tied to the target's lm_head.*pass the target model"):
        export(tmp_path / "src", tmp_path / "out", "medusa")
    rep = export(tmp_path / "src", tmp_path / "out", "medusa", tiny)
    t = read_tensors(tmp_path / "out", ("medusa_lm_head.safetensors",))
    assert set(t) == fd_names(3, 1) and rep.tensors == 9
    for i in range(3):
        assert torch.equal(t[f"{i}.1.weight"], tiny.lm_head.weight)
        assert torch.equal(t[f"{i}.0.linear.bias"], torch.zeros(H))          # ResBlock has a bias: zeros
    assert cfg_of(tmp_path / "out")["tie_lm_head"] is False
    assert any("base_model_name_or_path not written" in n for n in rep.notes)
    loaded = load_medusa_heads(tmp_path / "out", tiny)
    assert loaded.cfg == replace(heads.cfg, tied_lm_head=False, block_bias=True)
    for i in range(3):
        assert torch.equal(loaded.blocks[i].layers[0].weight, heads.blocks[i].layers[0].weight)
    f = torch.randn(2, H, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(loaded(f), heads(f))      # batched vs per-head matmul


def test_medusa_tied_to_vllm(tiny, tmp_path):
    heads = medusa(tiny, tied=True, bias=False)
    save_medusa_heads(heads, tmp_path / "src", MedusaLayout.VLLM)
    export(tmp_path / "src", tmp_path / "out", "vllm", tiny)
    cfg, t = cfg_of(tmp_path / "out"), read_tensors(tmp_path / "out")
    assert cfg["original_lm_head"] is True and cfg["medusa_fc_bias"] is False
    assert set(t) == {f"blocks.{i}.layers.0.weight" for i in range(3)} | {"lm_heads.0.weight"}
    assert torch.equal(t["lm_heads.0.weight"], tiny.lm_head.weight)
    same_tensors(heads.state_dict(), {k: v for k, v in t.items() if k.startswith("blocks.")})


# -- errors, destination, CLI ------------------------------------------------------------------------------
def test_wrong_format_for_source(tiny, tmp_path):
    save_eagle_head(eagle_head(tiny, HeadKind.EAGLE3), tmp_path / "e3")
    with pytest.raises(CheckpointError, match="'medusa' does not fit an EAGLE-3 head.*valid formats: eagle, sglang, vllm"):
        export(tmp_path / "e3", tmp_path / "out", ExportFormat.MEDUSA)
    save_medusa_heads(medusa(tiny, tied=False), tmp_path / "m")
    for fmt in ("sglang", "eagle"):
        with pytest.raises(CheckpointError, match="valid formats: medusa, vllm"):
            export(tmp_path / "m", tmp_path / "out", fmt)
    with pytest.raises(CheckpointError, match="unknown export format 'onnx'"):
        export(tmp_path / "m", tmp_path / "out", "onnx")


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
@pytest.mark.parametrize("damage", ["missing", "shape"])
def test_corrupt_source(tiny, tmp_path, kind, damage):
    if kind == "eagle3":
        save_eagle_head(eagle_head(tiny, HeadKind.EAGLE3), tmp_path / "src")
        weights, name = "model.safetensors", "midlayer.mlp.up_proj.weight"
    else:
        save_medusa_heads(medusa(tiny, tied=False), tmp_path / "src")
        weights, name = "medusa_lm_head.safetensors", "1.1.weight"
    t = read_tensors(tmp_path / "src", (weights,))
    if damage == "missing":
        del t[name]
    else:
        t[name] = torch.zeros(2, 2)
    write_tensors(tmp_path / "src", t, weights)
    with pytest.raises(CheckpointError, match="missing tensors" if damage == "missing" else "checkpoint shape"):
        export(tmp_path / "src", tmp_path / "out", "vllm", tiny)
    assert not (tmp_path / "out").exists()


def test_destination_rules(tiny, tmp_path):
    save_eagle_head(eagle_head(tiny, HeadKind.EAGLE3), tmp_path / "src")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "pytorch_model.bin").write_bytes(b"stale")
    (tmp_path / "out" / "README.md").write_text("keep")
    with pytest.raises(CheckpointError, match="not empty; pass overwrite=True"):
        export(tmp_path / "src", tmp_path / "out", "vllm")
    with pytest.raises(CheckpointError, match="is the source folder"):
        export(tmp_path / "src", tmp_path / "src", "vllm", overwrite=True)
    with pytest.warns(ExportWarning):
        path = export_checkpoint(tmp_path / "src", tmp_path / "out", "eagle", overwrite=True)
    export_checkpoint(tmp_path / "src", tmp_path / "out", "vllm", overwrite=True)
    assert path == tmp_path / "out" and files(path) == {"config.json", "model.safetensors", "README.md"}


def test_cli(tiny, tmp_path, capsys, monkeypatch):
    from verispec.cli import main
    from verispec.cli import export as cli_export
    save_medusa_heads(medusa(tiny, tied=True), tmp_path / "src")
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "a"), "--format", "medusa"]) == 1
    assert "pass the target model" in capsys.readouterr().err
    monkeypatch.setattr(cli_export, "_load_target", lambda name, dtype: tiny)
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "a"), "--format", "vllm", "--target", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "exported medusa -> vllm" in out and "model.safetensors" in out and "(7 tensors)" in out
    assert "note: tied heads" in out
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "b"), "--format", "sglang"]) == 1
    assert "valid formats: medusa, vllm" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "a"), "--format", "vllm", "--target", "t"]) == 1
    assert "--overwrite" in capsys.readouterr().err
