"""Exports are loaded by the consumers themselves: the PyPI wheels of SpecForge, speculators (the
format vLLM reads), the EAGLE repo (eagle-llm) and FasterDecoding Medusa (medusa-llm) load what
``train.export`` writes for tiny random heads on a tiny random Llama target, with their own
classes and loading code, and compute the same outputs as our heads on the same inputs.

The wheels are installed with ``pip --no-deps`` (Makefile ``setup``): their pins (torch 2.11,
transformers 5.8 / <= 5.19, accelerate 0.21, sglang, flash-attn, ...) clash with ours. Where their
code meets our newer transformers (5.24) or an absent training-only dependency, the test bridges
exactly that and says why:
- speculators imports ``datasets`` and ``hs_connectors`` (training-data loading) at package import;
  neither is needed to convert or run a head, so they are stub modules here. Its
  ``Eagle3DraftModel`` marks a checkpoint without ``embed_tokens.weight`` (ours: the head shares
  the target's) by initialising the embedding to NaN, and ``load_verifier_weights`` replaces only a
  NaN embedding; transformers 5.24's ``from_pretrained`` leaves tensors absent from the checkpoint
  as uninitialised memory instead, so the test asks speculators' own loader to overwrite it
  (``_load_verifier_weights(overwrite_embed_tokens=True)``);
- SpecForge's draft model wraps its norms / RoPE in ``torch.compile``; compiling them costs about
  25 s on this CPU, so the test runs the same functions eagerly (``no_compile``); and
  transformers 5.24's ``from_pretrained`` leaves the non-persistent RoPE caches SpecForge builds in
  ``__init__`` uninitialised (non-finite), so they are rebuilt with SpecForge's own ``_init_rope``;
- the EAGLE repo's and Medusa's own Llama copies (``modeling_llama_kv``) and EAGLE's ``EConfig``
  read ``config.rope_scaling["type"]``, which transformers 5 fills with ``{"rope_type": "default"}``
  instead of None: the base model is transformers' ``LlamaForCausalLM`` (the same weights) and
  EAGLE's config gets back the ``None`` transformers 4 gave for "no scaling".
Everything else (config parsing, file names, tensor names, strict loading, the forward) is theirs.

Not loaded by a consumer here (no pure-Python, CPU-runnable code for them on PyPI; ``test_export``
checks their names and configs): vLLM and SGLang themselves (CUDA builds), the ``eagle`` export of
EAGLE-3 heads (eagle-llm 1.2.1 predates EAGLE-3), the ``vllm`` / ``sglang`` exports of EAGLE-1 heads
and the ``vllm`` export of Medusa heads.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import types

import pytest
import torch

from helpers import randomise, save_random_hf, tiny_head_config

from verispec.core.features import TargetFeatures
from verispec.drafting.eagle_head import HeadKind, new_eagle_head
from verispec.drafting.medusa_head import MedusaConfig, MedusaHeads
from verispec.formats import eagle3, read_tensors, save_eagle_head, save_medusa_heads
from verispec.train.export import export

V, H, L, T = 64, 32, 8, 6           # target vocabulary, hidden size, layers; tokens per forward
DRAFT = 40                          # EAGLE-3 draft vocabulary
INSTALL = "installed by `make setup` (pip install --no-deps, see Makefile)"

pytestmark = pytest.mark.usefixtures("module_single_thread")


# -- the tiny target, as a Hugging Face folder and as our Transformer ------------------------------------
@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A random tiny Llama saved by transformers (with a word-level tokenizer: consumers load one)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return save_random_hf(LlamaForCausalLM(cfg), tmp_path_factory.mktemp("target"), V)


@pytest.fixture(scope="module")
def target(target_dir):
    from verispec.models.loading import load_model
    return load_model(target_dir, with_tokenizer=False).model


@pytest.fixture(scope="module")
def hf_target(target_dir):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(target_dir).eval()


@pytest.fixture
def no_compile():
    """``torch.compile``-wrapped functions run eagerly (the same code, without inductor's CPU build).
    Through ``config.patch``: pytest's monkeypatch undoes a config attribute by deleting it, which
    hides the option and breaks every later ``torch.compile`` in the process."""
    with torch._dynamo.config.patch(disable=True):
        yield


def require(module: str, wheel: str) -> None:
    """Skip when the consumer's wheel is absent; once present, any import error is a failure."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{wheel} not installed ({INSTALL})")


def stub_modules(monkeypatch, *names: str) -> None:
    """Importable stand-ins for modules a consumer imports but the tested path never calls."""
    def missing(name, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {"__init__": lambda *a, **k: pytest.fail(f"stubbed {name}.{attr} was used")})
    for name in names:
        mod = types.ModuleType(name)
        mod.__getattr__ = lambda attr, name=name: missing(name, attr)
        mod.__path__ = []
        monkeypatch.setitem(sys.modules, name, mod)


# -- heads ---------------------------------------------------------------------------------------------
def eagle3_head(target, **overrides):
    cfg = tiny_head_config(HeadKind.EAGLE3, V, H, L, draft_vocab_size=DRAFT, **overrides)
    head = randomise(new_eagle_head(cfg, target), seed=1)
    keep = torch.randperm(V, generator=torch.Generator().manual_seed(2))[:DRAFT].sort().values
    head.d2t.copy_(keep - torch.arange(DRAFT))
    head.t2d.zero_()
    head.t2d[keep] = True
    return head


def eagle3_inputs(head):
    """Three aux features per position, tokens, positions; our head's output on them."""
    g = torch.Generator().manual_seed(3)
    aux = [torch.randn(T, H, generator=g) for _ in head.aux_layers]
    ids, pos = torch.randint(0, V, (1, T), generator=g), torch.arange(T)[None]
    with torch.no_grad():
        fused = head.fuse(TargetFeatures(hidden=dict(zip(head.aux_layers, aux)), last_hidden=None))
        out = head(ids, pos, fused[None])
    return torch.cat(aux, -1)[None], ids, pos, out


def exported(tmp_path, save, head, fmt: str, target, **kw):
    save(head, tmp_path / "src")
    report = export(tmp_path / "src", tmp_path / fmt, fmt, target, **kw)
    return report.path, json.loads((report.path / "config.json").read_text())


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-4)


# -- EAGLE-3: speculators (vLLM's format) -----------------------------------------------------------------
@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_speculators_converts_and_runs_our_vllm_eagle3_export(tmp_path, target, target_dir, monkeypatch,
                                                              norm_before_residual):
    """speculators' ``Eagle3Converter`` turns our ``vllm`` export into its format (vLLM's), its own
    validation loads it, and its ``Eagle3DraftModel`` gives our head's logits (same d2t / t2d / aux ids),
    for plain heads and for speculators' ``norm_before_residual`` variant (residual after hidden_norm)."""
    require("speculators", "speculators==0.9.0")
    stub_modules(monkeypatch, "datasets", "hs_connectors")
    from safetensors.torch import load_file
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    head = eagle3_head(target, norm_before_residual=norm_before_residual)
    out, cfg = exported(tmp_path, save_eagle_head, head, "vllm", target)
    assert cfg.get("norm_before_residual", False) is norm_before_residual
    Eagle3Converter().convert(out, tmp_path / "spec", base_model=str(target_dir), validate=True,
                              norm_before_residual=norm_before_residual,
                              eagle_aux_hidden_state_layer_ids=cfg["eagle_aux_hidden_state_layer_ids"])
    spec_cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert eagle3.config_from_json(spec_cfg, target.cfg, False).norm_before_residual is norm_before_residual
    converted = load_file(str(tmp_path / "spec" / "model.safetensors"))
    ours = read_tensors(out)
    assert set(converted) == {k.replace("midlayer.", "layers.0.") for k in ours}      # nothing dropped or added
    model = Eagle3DraftModel.from_pretrained(str(tmp_path / "spec")).eval()          # flex attention, as it trains
    assert isinstance(model.config, Eagle3SpeculatorConfig) and model.config.draft_vocab_size == DRAFT
    model._load_verifier_weights(overwrite_embed_tokens=True)     # the target's embedding (see the top)
    loaded = model.state_dict()
    for name, t in converted.items():
        assert loaded[name].shape == t.shape and torch.equal(loaded[name], t), name
    assert model.target_layer_ids == list(head.cfg.aux_layer_ids)
    assert torch.equal(model.d2t, head.d2t) and torch.equal(model.t2d, head.t2d)
    aux, ids, pos, want = eagle3_inputs(head)
    logits = {}
    model.lm_head.register_forward_hook(lambda mod, args, result: logits.setdefault("step0", result))
    with torch.no_grad():
        model(aux, ids, torch.zeros(1, T, dtype=torch.long), position_ids=pos, ttt_steps=1)
    close(logits["step0"], want.logits)


# -- EAGLE-3: SpecForge ------------------------------------------------------------------------------------
def test_specforge_loads_our_sglang_eagle3_export(tmp_path, target, target_dir, no_compile):
    """SpecForge's ``AutoDraftModel.from_pretrained`` loads our ``sglang`` export (the layout SpecForge
    writes for SGLang) into its ``LlamaForCausalLMEagle3``: every tensor but the shared embedding
    (``load_embedding`` reads the target's), and its backbone and logits equal ours."""
    require("specforge", "specforge==0.2.0")
    import specforge.modeling.draft.llama3_eagle as sf_eagle
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
    from transformers import AutoConfig

    head = eagle3_head(target)
    out, cfg = exported(tmp_path, save_eagle_head, head, "sglang", target)
    assert AutoDraftModelConfig.from_file(str(out / "config.json")).draft_vocab_size == DRAFT
    fresh = AutoDraftModel.from_config(AutoConfig.from_pretrained(out))
    missing, unexpected = fresh.load_state_dict(read_tensors(out), strict=False)
    assert (missing, unexpected) == (["embed_tokens.weight"], [])
    model = AutoDraftModel.from_pretrained(str(out)).eval()
    assert isinstance(model, sf_eagle.LlamaForCausalLMEagle3)
    model.midlayer.self_attn._init_rope()       # transformers 5.24 leaves its RoPE caches uninitialised
    model.load_embedding(str(target_dir))
    for name, t in read_tensors(out).items():
        assert torch.equal(model.state_dict()[name], t), name
    aux, ids, pos, want = eagle3_inputs(head)
    with torch.no_grad():
        hidden = model.project_hidden_states(aux)
        mask = sf_eagle.prepare_decoder_attention_mask(torch.ones(1, T, dtype=torch.bool), (1, T), hidden, 0)
        state = model.backbone(model.embed_input_ids(ids), hidden, None, mask, pos, use_cache=False)
        logits = model.compute_logits(state)
    close(state, want.hidden)
    close(logits, want.logits)


# -- EAGLE-1: the EAGLE repo -------------------------------------------------------------------------------
def eagle1_head(target):
    return randomise(new_eagle_head(tiny_head_config(HeadKind.EAGLE1, V, H, L, fc_bias=True), target), seed=4)


def rope_scaling_none_for_default(config_cls):
    """EAGLE's config class, with transformers 4's ``rope_scaling`` None for "no scaling" (see top)."""
    class Config(config_cls):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            if (self.rope_scaling or {}).get("rope_type") == "default":
                self.rope_scaling = None
    return Config


@pytest.mark.parametrize("loader", ["EaModel", "modeling_eagle.EAGLE"])
def test_eagle_repo_loads_our_eagle1_export(tmp_path, target, target_dir, hf_target, monkeypatch, loader):
    """The EAGLE repo loads our ``eagle`` export of an EAGLE-1 head (config ``bias``, fc bias,
    ``pytorch_model.bin``, ``load_state_dict(strict=True)``) with ``EaModel.from_pretrained`` and
    with ``modeling_eagle.EAGLE``; its head's output feature and logits equal ours."""
    require("eagle", "eagle-llm==1.2.1")
    import eagle.model.ea_model as ea_model
    import eagle.modeling_eagle as modeling_eagle

    head = eagle1_head(target)
    out, cfg = exported(tmp_path, save_eagle_head, head, "eagle", target)
    assert cfg["bias"] is True and (out / "pytorch_model.bin").exists()
    if loader == "EaModel":
        monkeypatch.setattr(ea_model, "KVLlamaForCausalLM", type(hf_target))
        monkeypatch.setattr(ea_model, "EConfig", rope_scaling_none_for_default(ea_model.EConfig))
        layer = ea_model.EaModel.from_pretrained(base_model_path=str(target_dir), ea_model_path=str(out)).ea_layer
    else:
        monkeypatch.setattr(modeling_eagle, "EAGLE_Config", rope_scaling_none_for_default(modeling_eagle.EAGLE_Config))
        layer = modeling_eagle.EAGLE(hf_target, str(out)).ea_layer
    g = torch.Generator().manual_seed(5)
    feature, ids = torch.randn(1, T, H, generator=g), torch.randint(0, V, (1, T), generator=g)
    with torch.no_grad():
        want = head(ids, torch.arange(T)[None], feature)
        got = layer(feature, ids)
    close(got, want.hidden)
    close(got @ target.lm_head.weight.T, want.logits)


# -- Medusa: FasterDecoding ---------------------------------------------------------------------------------
def test_medusa_model_loads_our_medusa_export(tmp_path, target, target_dir, hf_target, monkeypatch):
    """FasterDecoding's ``MedusaModel.from_pretrained`` loads our ``medusa`` export (its config, its
    ``medusa_lm_head.pt``; every key, as a strict load confirms) and its forward gives our heads'
    logits on the base model's last hidden state."""
    require("medusa", "medusa-llm==0.1")
    import medusa.model.medusa_model as medusa_model

    heads = randomise(MedusaHeads(MedusaConfig(3, 1, H, V)), seed=6)
    out, cfg = exported(tmp_path, save_medusa_heads, heads, "medusa", target, base_model_name_or_path=str(target_dir))
    monkeypatch.setattr(medusa_model, "KVLlamaForCausalLM", type(hf_target))
    model = medusa_model.MedusaModel.from_pretrained(str(out))
    assert (model.medusa, model.medusa_num_layers) == (3, 1)
    model.medusa_head.load_state_dict(torch.load(out / "medusa_lm_head.pt"), strict=True)
    ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = model(ids)                                                  # [K, 1, T, V]
        want = heads(hf_target.model(ids).last_hidden_state)             # [1, T, K, V]
    close(got, want.permute(2, 0, 1, 3))
