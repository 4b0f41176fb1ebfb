"""Head checkpoints: save -> load round trips give identical proposals; checkpoints written with
the official tensor names (SpecForge / EAGLE repo / vLLM / FasterDecoding, built here from random
tensors) load and compute what those names mean; each malformed checkpoint gives its error."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from helpers import tiny_llama
from verispec.formats import (CheckpointError, MedusaLayout, load_eagle_head, load_medusa_heads,
                                  new_eagle_head, save_eagle_head, save_medusa_heads, write_config,
                                  write_tensors)
from verispec.core.features import TargetFeatures
from verispec.drafting.base import DraftRequest
from verispec.drafting.dynamic_tree import DynamicTreeConfig, StaticTreeConfig
from verispec.drafting.eagle import EagleDrafter
from verispec.drafting.eagle_head import EagleHeadConfig, HeadKind, init_head_weights
from verispec.drafting.medusa import MedusaDrafter
from verispec.drafting.medusa_head import MedusaConfig, MedusaHeads
from verispec.core.sampling import SamplingParams

V, H, L = 24, 32, 6           # tiny target: vocab, hidden, layers
DRAFT_IDS = torch.tensor([0, 1, 2, 4, 5, 7, 8, 10, 11, 13, 16, 17, 19, 20, 22, 23])

pytestmark = pytest.mark.usefixtures("module_single_thread")   # tiny models: one thread


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(V, H, L)


def eagle_cfg(kind: HeadKind, **kw) -> EagleHeadConfig:
    base = dict(kind=kind, hidden_size=H, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8,
                vocab_size=V, draft_vocab_size=V, target_hidden_size=H, target_num_layers=L,
                aux_layer_ids=EagleHeadConfig.default_aux_layer_ids(L) if kind is HeadKind.EAGLE3 else ())
    return EagleHeadConfig(**(base | kw))


def make_head(tiny, kind: HeadKind, seed: int = 0, **kw):
    head = init_head_weights(new_eagle_head(eagle_cfg(kind, **kw), tiny), seed, std=0.3)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)                # distinguishable norms
    if head.cfg.kind is HeadKind.EAGLE3 and head.cfg.draft_vocab_size < V:
        head.d2t.copy_(DRAFT_IDS - torch.arange(len(DRAFT_IDS)))
        head.t2d.zero_()
        head.t2d[DRAFT_IDS] = True
    return head


@torch.no_grad()
def proposals(tiny, head, tree=None):
    """Trees proposed for two rows over a fixed token sequence (greedy)."""
    tree = tree or DynamicTreeConfig(topk=3, depth=3, num_draft_tokens=8)
    drafter = EagleDrafter(head, tree, max_batch=2, max_len=40)
    seq = torch.randint(0, V, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    o = tiny(torch.tensor([seq]), torch.arange(20)[None], hidden_layers=drafter.hidden_layers)
    feats = TargetFeatures({i: o.hidden[i][0] for i in drafter.hidden_layers}, o.last_hidden[0])
    out = []
    for row, m in ((0, 7), (1, 11)):
        drafter.start(row, seq[:m], TargetFeatures({i: h[:m] for i, h in feats.hidden.items()}, feats.last_hidden[:m]))
    reqs = [DraftRequest(row, seq[:m + 1], SamplingParams(temperature=0), torch.Generator())
            for row, m in ((0, 7), (1, 11))]
    for t in drafter.propose(reqs):
        out.append((t.tokens.tolist(), t.parents.tolist()))
    return out


# -- round trips -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,kw,weights", [
    (HeadKind.EAGLE3, {"draft_vocab_size": len(DRAFT_IDS)}, "model.safetensors"),
    (HeadKind.EAGLE3, {"fc_norm": True, "norm_output": True, "own_embedding": True}, "pytorch_model.bin"),
    (HeadKind.EAGLE1, {"fc_bias": True}, "model.safetensors"),
    (HeadKind.EAGLE1, {"own_embedding": True}, "pytorch_model.bin"),
], ids=["eagle3-d2t", "eagle3.1-own-embed-bin", "eagle1", "eagle1-own-embed-bin"])
def test_eagle_round_trip(tiny, tmp_path, kind, kw, weights):
    head = make_head(tiny, kind, **kw)
    save_eagle_head(head, tmp_path / "h", weights)
    assert (tmp_path / "h" / weights).exists()
    loaded = load_eagle_head(tmp_path / "h", tiny, kind)
    assert loaded.cfg == head.cfg
    for (n1, a), (n2, b) in zip(sorted(head.state_dict().items()), sorted(loaded.state_dict().items())):
        assert n1 == n2 and torch.equal(a, b), n1
    assert proposals(tiny, loaded) == proposals(tiny, head)
    tree = StaticTreeConfig.from_choices([[0], [1], [0, 0], [0, 0, 0]])
    assert proposals(tiny, loaded, tree) == proposals(tiny, head, tree)


def test_exported_config_is_what_vllm_reads(tiny, tmp_path):
    save_eagle_head(make_head(tiny, HeadKind.EAGLE3, draft_vocab_size=len(DRAFT_IDS), fc_norm=True), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == len(DRAFT_IDS) and cfg["target_hidden_size"] == H
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
    assert cfg["fc_norm"] is True and "norm_output" not in cfg   # absent: off (SpecForge reads False otherwise)
    from safetensors.torch import load_file
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d", "fc_norm.0.weight", "fc_norm.2.weight"} <= names
    assert "embed_tokens.weight" not in names                   # shared with the target


# -- official names, built by hand -----------------------------------------------------------------
def specforge_tensors(g: torch.Generator, draft: int = len(DRAFT_IDS), hidden: int = H) -> dict:
    """What SpecForge's LlamaForCausalLMEagle3 exports (random values)."""
    r = lambda *s: torch.randn(*s, generator=g) * 0.3                     # noqa: E731
    t = {"fc.weight": r(hidden, 3 * H), "norm.weight": 1 + r(hidden) * 0.1, "lm_head.weight": r(draft, hidden),
         "embed_tokens.weight": r(V, hidden), "d2t": DRAFT_IDS[:draft] - torch.arange(draft)}
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[DRAFT_IDS[:draft]] = True
    t["t2d"] = t2d
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        t[f"midlayer.{n}.weight"] = 1 + r(hidden) * 0.1
    for p, rows in (("q", 32), ("k", 16), ("v", 16)):
        t[f"midlayer.self_attn.{p}_proj.weight"] = r(rows, 2 * hidden)
    t["midlayer.self_attn.o_proj.weight"] = r(hidden, 32)
    t["midlayer.mlp.gate_proj.weight"], t["midlayer.mlp.up_proj.weight"] = r(48, hidden), r(48, hidden)
    t["midlayer.mlp.down_proj.weight"] = r(hidden, 48)
    return t


def specforge_config(**kw) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
            "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": len(DRAFT_IDS), "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16"} | kw


def write_ckpt(folder, cfg: dict, tensors: dict, name: str = "model.safetensors"):
    write_config(folder, cfg)
    write_tensors(folder, tensors, name)
    return folder


def rms(x, w, eps=1e-6):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_specforge_checkpoint_loads_and_means_what_it_says(tiny, tmp_path):
    """One pair without cache: attention over a single key returns its value, so the output is
    computable by hand from the official tensors (concat order, which norm goes where, d2t)."""
    t = specforge_tensors(torch.Generator().manual_seed(3))
    head = load_eagle_head(write_ckpt(tmp_path, specforge_config(), t), tiny, HeadKind.EAGLE3)
    assert head.aux_layers == (1, 2, 2) and head.hidden_layers == (1, 2)   # default ids (2, 3, 3), 6 layers
    feats = TargetFeatures({i: torch.randn(1, H) for i in (1, 2)})
    tok = torch.tensor([[5]])
    fused = F.linear(torch.cat([feats.hidden[1], feats.hidden[2], feats.hidden[2]], -1), t["fc.weight"])
    x = torch.cat([rms(t["embed_tokens.weight"][5], t["midlayer.input_layernorm.weight"]),
                   rms(fused[0], t["midlayer.hidden_norm.weight"])])
    v = F.linear(x, t["midlayer.self_attn.v_proj.weight"]).view(2, 8).repeat_interleave(2, 0).flatten()
    h = fused[0] + F.linear(v, t["midlayer.self_attn.o_proj.weight"])
    hn = rms(h, t["midlayer.post_attention_layernorm.weight"])
    mlp = F.silu(F.linear(hn, t["midlayer.mlp.gate_proj.weight"])) * F.linear(hn, t["midlayer.mlp.up_proj.weight"])
    h = h + F.linear(mlp, t["midlayer.mlp.down_proj.weight"])
    logits = F.linear(rms(h, t["norm.weight"]), t["lm_head.weight"])
    out = head(tok, torch.zeros(1, 1, dtype=torch.long), head.fuse(feats)[None])
    torch.testing.assert_close(out.logits[0, 0], logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.hidden[0, 0], h, atol=1e-4, rtol=1e-4)       # EAGLE-3 feeds back pre-norm
    assert head.draft_to_target(torch.tensor([3])).item() == int(DRAFT_IDS[3])


def test_vllm_and_eagle31_names_load(tiny, tmp_path):
    t = specforge_tensors(torch.Generator().manual_seed(4))
    t = {("model." + k.replace("midlayer.", "layers.0.") if k not in ("lm_head.weight", "d2t", "t2d") else k): v
         for k, v in t.items()}
    t.update({f"model.fc_norm.{i}.weight": torch.rand(H) + 0.5 for i in range(3)})
    cfg = specforge_config(fc_norm=True, norm_output=True, architectures=["LlamaForCausalLM"],
                           eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 6]})
    head = load_eagle_head(write_ckpt(tmp_path, cfg, t), tiny, HeadKind.EAGLE3)
    assert head.cfg.fc_norm and head.cfg.norm_output and head.hidden_layers == (0, 2, 5)
    assert torch.equal(head.fc_norm[1].weight, t["model.fc_norm.1.weight"])
    assert torch.equal(head.attn.wq.weight, t["model.layers.0.self_attn.q_proj.weight"])


def eagle1_tensors(g: torch.Generator) -> dict:
    r = lambda *s: torch.randn(*s, generator=g) * 0.3                     # noqa: E731
    t = {"fc.weight": r(H, 2 * H), "fc.bias": r(H), "layers.0.post_attention_layernorm.weight": 1 + r(H) * 0.1,
         "layers.0.self_attn.q_proj.weight": r(32, H), "layers.0.self_attn.k_proj.weight": r(16, H),
         "layers.0.self_attn.v_proj.weight": r(16, H), "layers.0.self_attn.o_proj.weight": r(H, 32),
         "layers.0.mlp.gate_proj.weight": r(48, H), "layers.0.mlp.up_proj.weight": r(48, H),
         "layers.0.mlp.down_proj.weight": r(H, 48)}
    return t


def test_eagle1_repo_checkpoint_loads_and_means_what_it_says(tiny, tmp_path):
    t = eagle1_tensors(torch.Generator().manual_seed(5))
    t["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)         # old exports carry it
    cfg = specforge_config(architectures=["LlamaForCausalLM"], bias=True)
    head = load_eagle_head(write_ckpt(tmp_path, cfg, t, "pytorch_model.bin"), tiny, HeadKind.EAGLE1)
    assert head.needs_last_hidden and head.hidden_layers == ()
    f = torch.randn(1, H)
    x = F.linear(torch.cat([tiny.embed.weight[7], f[0]]), t["fc.weight"], t["fc.bias"])   # [embedding; feature]
    v = F.linear(x, t["layers.0.self_attn.v_proj.weight"]).view(2, 8).repeat_interleave(2, 0).flatten()
    x = x + F.linear(v, t["layers.0.self_attn.o_proj.weight"])              # no input_layernorm
    hn = rms(x, t["layers.0.post_attention_layernorm.weight"])
    mlp = F.silu(F.linear(hn, t["layers.0.mlp.gate_proj.weight"])) * F.linear(hn, t["layers.0.mlp.up_proj.weight"])
    x = x + F.linear(mlp, t["layers.0.mlp.down_proj.weight"])
    out = head(torch.tensor([[7]]), torch.zeros(1, 1, dtype=torch.long), head.fuse(TargetFeatures({}, f))[None])
    torch.testing.assert_close(out.hidden[0, 0], x, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.logits[0, 0], tiny.lm_head(x), atol=1e-4, rtol=1e-4)  # target's lm_head


# -- malformed EAGLE checkpoints ---------------------------------------------------------------------
def _drop(t, k):
    t = dict(t)
    del t[k]
    return t


MALFORMED_EAGLE3 = [
    ("missing tensor", {}, lambda t: _drop(t, "midlayer.mlp.up_proj.weight"), "missing tensors"),
    ("unknown tensor", {}, lambda t: t | {"midlayer.extra.weight": torch.ones(2)}, "unknown tensors"),
    ("two layers", {"num_hidden_layers": 2}, None, "one decoder layer"),
    ("wrong architecture", {"architectures": ["MistralForCausalLM"]}, None, "not an EAGLE-3 head"),
    ("target hidden size", {"target_hidden_size": 64}, None, "target hidden size 64"),
    ("vocab", {"vocab_size": 32000}, None, "vocab_size 32000"),
    ("draft vocab shape", {"draft_vocab_size": 12}, None, "d2t must be"),
    ("d2t out of range", {}, lambda t: t | {"d2t": t["d2t"] + 100}, "outside the target vocabulary"),
    ("d2t repeats", {}, lambda t: t | {"d2t": -torch.arange(len(DRAFT_IDS))}, "repeated ids"),
    ("t2d disagrees", {}, lambda t: t | {"t2d": torch.ones(V, dtype=torch.bool)}, "t2d does not mark"),
    ("lm_head rows", {}, lambda t: t | {"lm_head.weight": torch.zeros(10, H)}, "lm_head.weight: checkpoint shape"),
    ("fc width", {}, lambda t: t | {"fc.weight": torch.zeros(H, 2 * H)}, "fc.weight: checkpoint shape"),
    ("aux ids", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 6]}}, None, "out of range"),
    ("no shared embedding", {"hidden_size": 40, "target_hidden_size": H}, lambda t: _drop(t, "embed_tokens.weight"),
     "shares the target's"),
    ("an EAGLE-1 head", {}, lambda t: eagle1_tensors(torch.Generator()), "not an EAGLE-3 head"),
    ("no d2t, reduced vocab", {}, lambda t: _drop(t, "d2t"), "missing tensors"),
]


@pytest.mark.parametrize("name,cfg_kw,edit,match", MALFORMED_EAGLE3, ids=[m[0] for m in MALFORMED_EAGLE3])
def test_malformed_eagle3(tiny, tmp_path, name, cfg_kw, edit, match):
    t = specforge_tensors(torch.Generator().manual_seed(6))
    t = edit(t) if edit else t
    with pytest.raises(CheckpointError, match=match):
        load_eagle_head(write_ckpt(tmp_path, specforge_config(**cfg_kw), t), tiny, HeadKind.EAGLE3)


def test_malformed_files(tiny, tmp_path):
    with pytest.raises(CheckpointError, match="not a folder"):
        load_eagle_head(tmp_path / "absent", tiny, HeadKind.EAGLE3)
    (tmp_path / "a").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_eagle_head(tmp_path / "a", tiny, HeadKind.EAGLE3)
    (tmp_path / "a" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_eagle_head(tmp_path / "a", tiny, HeadKind.EAGLE3)
    write_config(tmp_path / "b", specforge_config())
    with pytest.raises(CheckpointError, match="has none of"):
        load_eagle_head(tmp_path / "b", tiny, HeadKind.EAGLE3)
    (tmp_path / "b" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_eagle_head(tmp_path / "b", tiny, HeadKind.EAGLE3)
    t = specforge_tensors(torch.Generator())
    with pytest.raises(CheckpointError, match="use method 'eagle3'"):
        load_eagle_head(write_ckpt(tmp_path / "c", specforge_config(), t), tiny, HeadKind.EAGLE1)
    with pytest.raises(CheckpointError, match="EAGLE-1 head hidden size"):
        load_eagle_head(write_ckpt(tmp_path / "d", specforge_config(hidden_size=40), eagle1_tensors(torch.Generator())),
                        tiny, HeadKind.EAGLE1)


# -- Medusa ------------------------------------------------------------------------------------------
def medusa_heads(tiny, tied: bool, heads: int = 3, layers: int = 1, seed: int = 0) -> MedusaHeads:
    m = MedusaHeads(MedusaConfig(heads, layers, H, V, tied_lm_head=tied), tiny.lm_head.weight.detach())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m.eval()


def medusa_proposals(heads):
    drafter = MedusaDrafter(heads, StaticTreeConfig.from_choices([[0], [1], [0, 0], [0, 1], [0, 0, 0]]))
    g = torch.Generator().manual_seed(2)
    out = []
    for row in range(2):
        drafter.start(row, [1, 2, 3], TargetFeatures({}, torch.randn(3, H, generator=g)))
    reqs = [DraftRequest(row, [1, 2, 3, 4], SamplingParams(temperature=0), g) for row in range(2)]
    for t in drafter.propose(reqs):
        out.append((t.tokens.tolist(), t.parents.tolist()))
    return out


@pytest.mark.parametrize("layout", list(MedusaLayout))
@pytest.mark.parametrize("tied", [False, True])
def test_medusa_round_trip(tiny, tmp_path, layout, tied):
    heads = medusa_heads(tiny, tied)
    save_medusa_heads(heads, tmp_path, layout)
    loaded = load_medusa_heads(tmp_path, tiny)
    assert loaded.cfg == heads.cfg
    assert all(torch.equal(a, b) for a, b in zip(heads.state_dict().values(), loaded.state_dict().values()))
    assert medusa_proposals(loaded) == medusa_proposals(heads)


def test_faster_decoding_names_load(tiny, tmp_path):
    g = torch.Generator().manual_seed(7)
    t = {}
    for i in range(2):
        for j in range(2):
            t[f"{i}.{j}.linear.weight"] = torch.randn(H, H, generator=g)
            t[f"{i}.{j}.linear.bias"] = torch.randn(H, generator=g)
        t[f"{i}.2.weight"] = torch.randn(V, H, generator=g)
    write_ckpt(tmp_path, {"medusa_num_heads": 2, "medusa_num_layers": 2, "base_model_name_or_path": "x"}, t,
               "medusa_lm_head.pt")
    heads = load_medusa_heads(tmp_path, tiny)
    f = torch.randn(H, generator=g)
    x = f
    for j in range(2):
        x = x + F.silu(F.linear(x, t[f"1.{j}.linear.weight"], t[f"1.{j}.linear.bias"]))
    torch.testing.assert_close(heads(f)[1], F.linear(x, t["1.2.weight"]))
    save_medusa_heads(heads, tmp_path / "vllm", MedusaLayout.VLLM)
    from safetensors.torch import load_file
    names = set(load_file(str(tmp_path / "vllm" / "model.safetensors")))
    assert names == {f"blocks.{i}.layers.{j}.{k}" for i in range(2) for j in range(2) for k in ("weight", "bias")} \
        | {"lm_heads.0.weight", "lm_heads.1.weight"}
    cfg = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert cfg["num_heads"] == 2 and cfg["num_hidden_layers"] == 2 and cfg["medusa_fc_bias"] is True


MALFORMED_MEDUSA = [
    ("no counts", {}, None, "needs medusa_num_heads"),
    ("hidden size", {"hidden_size": 64}, None, "hidden_size 64"),
    ("vocab", {"vocab_size": 99}, None, "vocab_size 99"),
    ("more heads than config", {"medusa_num_heads": 1}, None, "beyond the config"),
    ("missing lm head", {}, lambda t: _drop(t, "1.1.weight"), "missing tensors"),
    ("unknown tensor", {}, lambda t: t | {"medusa.extra": torch.ones(1)}, "unknown tensors"),
    ("shape", {}, lambda t: t | {"0.1.weight": torch.zeros(V + 1, H)}, "checkpoint shape"),
]


@pytest.mark.parametrize("name,cfg_kw,edit,match", MALFORMED_MEDUSA, ids=[m[0] for m in MALFORMED_MEDUSA])
def test_malformed_medusa(tiny, tmp_path, name, cfg_kw, edit, match):
    g = torch.Generator().manual_seed(8)
    t = {}
    for i in range(2):
        t[f"{i}.0.linear.weight"], t[f"{i}.0.linear.bias"] = torch.randn(H, H, generator=g), torch.randn(H, generator=g)
        t[f"{i}.1.weight"] = torch.randn(V, H, generator=g)
    t = edit(t) if edit else t
    cfg = ({} if name == "no counts" else {"medusa_num_heads": 2, "medusa_num_layers": 1}) | cfg_kw
    with pytest.raises(CheckpointError, match=match):
        load_medusa_heads(write_ckpt(tmp_path, cfg, t, "medusa_lm_head.safetensors"), tiny)
