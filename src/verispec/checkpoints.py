"""Load and save draft-head checkpoints in the formats other tools read and write.

EAGLE-3 / 3.1 (EAGLE repo, SpecForge, SGLang, vLLM): a folder with ``config.json`` (a Llama
config: ``num_hidden_layers`` 1, ``draft_vocab_size``, optional ``target_hidden_size``,
``architectures`` ``LlamaForCausalLMEagle3`` or ``LlamaForCausalLM``, EAGLE-3.1 switches
``fc_norm`` / ``norm_output``, ``eagle_config.eagle_aux_hidden_state_layer_ids``) and
``model.safetensors`` (or ``pytorch_model.bin``) with ``fc.weight``, ``midlayer.*``,
``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``, optional ``embed_tokens.weight`` (absent:
the target's is shared) and ``fc_norm.{i}.weight``. Aux layer ids follow vLLM: id k is the hidden
state entering target layer k (= output of layer k-1); default (2, N/2, N-3).
EAGLE-1 (EAGLE repo): ``fc.weight`` [h, 2h] (+ ``fc.bias``), ``layers.0.*`` without
``input_layernorm``, optional ``embed_tokens.weight``; tokens come from the target's lm_head.
Medusa: FasterDecoding (``medusa_lm_head.safetensors`` / ``.pt``, tensors ``{i}.{j}.linear.weight``
/ ``.bias`` for block j of head i and ``{i}.{K}.weight`` for its vocabulary projection, config keys
``medusa_num_heads`` / ``medusa_num_layers``) or vLLM (``model.safetensors`` with
``blocks.{i}.layers.{j}.weight`` / ``.bias`` and ``lm_heads.{i}.weight``, config ``num_heads`` /
``num_hidden_layers``). A missing vocabulary projection is an error unless the config says
``tie_lm_head: true`` (our extension: heads use the target's lm_head).
Leading ``model.`` prefixes are accepted on load. Every mismatch raises ``CheckpointError``.
"""
from __future__ import annotations

import enum
import json
import re
from pathlib import Path

import torch
from torch import nn

from .draft_vocab import DraftVocab
from .drafters.eagle_head import Eagle1Head, Eagle3Head, EagleHead, EagleHeadConfig, HeadKind
from .drafters.medusa import MedusaConfig, MedusaHeads


class CheckpointError(ValueError):
    """A head checkpoint that does not fit the target or is malformed; the message says which."""


_ATTN = {"self_attn.q_proj": "attn.wq", "self_attn.k_proj": "attn.wk", "self_attn.v_proj": "attn.wv",
         "self_attn.o_proj": "attn.wo", "mlp.gate_proj": "mlp.w_gate", "mlp.up_proj": "mlp.w_up",
         "mlp.down_proj": "mlp.w_down"}
_EAGLE3_NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "LlamaForCausalLM", "Eagle3LlamaForCausalLM")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


# -- files -------------------------------------------------------------------------------------
def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder")
    if not path.exists():
        raise CheckpointError(f"{folder} has no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def read_tensors(folder: Path, names: tuple[str, ...] = WEIGHT_FILES) -> dict[str, torch.Tensor]:
    """Tensors of the first weight file found (or every ``*.safetensors`` shard)."""
    for name in names:
        path = folder / name
        if path.exists():
            return _load_file(path)
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        out = {}
        for s in shards:
            out.update(_load_file(s))
        return out
    raise CheckpointError(f"{folder} has none of {list(names)}")


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            return load_file(str(path))
        return dict(torch.load(str(path), map_location="cpu", weights_only=True))
    except Exception as e:  # noqa: BLE001 - any unreadable file is a checkpoint error
        raise CheckpointError(f"cannot read {path}: {e}") from e


def write_tensors(folder: Path, tensors: dict[str, torch.Tensor], name: str = "model.safetensors") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    if name.endswith(".safetensors"):
        from safetensors.torch import save_file
        save_file(tensors, str(folder / name))
    else:
        torch.save(tensors, str(folder / name))


def write_config(folder: Path, cfg: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# -- EAGLE name maps -----------------------------------------------------------------------------
def _eagle_names(cfg: EagleHeadConfig) -> dict[str, str]:
    """Official tensor name -> our parameter/buffer name, for the tensors this head has."""
    layer = "midlayer" if cfg.kind is HeadKind.EAGLE3 else "layers.0"
    out = {}
    for theirs, ours in _ATTN.items():
        out[f"{layer}.{theirs}.weight"] = f"{ours}.weight"
    if cfg.attention_bias:
        for p in ("q", "k", "v"):
            out[f"{layer}.self_attn.{p}_proj.bias"] = f"attn.w{p}.bias"
    out[f"{layer}.post_attention_layernorm.weight"] = "post_attention_layernorm.weight"
    out["fc.weight"] = "fc.weight"
    if cfg.own_embedding:
        out["embed_tokens.weight"] = "embed_tokens"
    if cfg.kind is HeadKind.EAGLE1:
        if cfg.fc_bias:
            out["fc.bias"] = "fc.bias"
        return out
    for n in ("input_layernorm", "hidden_norm"):
        out[f"midlayer.{n}.weight"] = f"{n}.weight"
    out.update({"norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight", "d2t": "d2t", "t2d": "t2d"})
    if cfg.fc_norm:
        out.update({f"fc_norm.{i}.weight": f"fc_norm.{i}.weight" for i in range(len(cfg.aux_layer_ids))})
    return out


def _normalise_names(state: dict[str, torch.Tensor], kind: HeadKind) -> dict[str, torch.Tensor]:
    """Strip ``model.`` prefixes, read vLLM's ``layers.0.`` as EAGLE-3's ``midlayer.``, drop
    RoPE buffers older exports carry (``rotary_emb.inv_freq``)."""
    out = {}
    for name, t in state.items():
        name = name[len("model."):] if name.startswith("model.") else name
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if kind is HeadKind.EAGLE3 and name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0."):]
        out[name] = t
    if kind is HeadKind.EAGLE1 and any(n.startswith("midlayer.") for n in out):
        raise CheckpointError("this is an EAGLE-3 checkpoint (midlayer.* tensors); use method 'eagle3'")
    if kind is HeadKind.EAGLE3 and "fc.weight" in out and "midlayer.hidden_norm.weight" not in out:
        raise CheckpointError("no midlayer.hidden_norm.weight: not an EAGLE-3 head (an EAGLE-1 head? "
                              "use method 'eagle')")
    return out


# -- EAGLE config ------------------------------------------------------------------------------
def eagle_config_from_json(cfg: dict, target_cfg, kind: HeadKind, has_embedding: bool,
                           has_fc_bias: bool, aux_layer_ids: tuple[int, ...] | None = None) -> EagleHeadConfig:
    """Our ``EagleHeadConfig`` from a head's config.json, checked against the target's config."""
    _check_json_arch(cfg, kind)
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        inter, vocab = int(cfg["intermediate_size"]), int(cfg["vocab_size"])
    except KeyError as e:
        raise CheckpointError(f"config.json lacks {e.args[0]!r}") from None
    if vocab != target_cfg.vocab_size:
        raise CheckpointError(f"head vocab_size {vocab} differs from the target's {target_cfg.vocab_size}")
    if kind is HeadKind.EAGLE1 and hidden != target_cfg.hidden_size:
        raise CheckpointError(f"EAGLE-1 head hidden size {hidden} differs from the target's {target_cfg.hidden_size}")
    target_hidden = int(cfg.get("target_hidden_size") or hidden)
    if target_hidden != target_cfg.hidden_size:
        raise CheckpointError(f"head expects target hidden size {target_hidden}, "
                              f"the target has {target_cfg.hidden_size}")
    if kind is HeadKind.EAGLE3:
        ids = aux_layer_ids or tuple((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or ()) \
            or EagleHeadConfig.default_aux_layer_ids(target_cfg.num_layers)
    else:
        ids = ()
    try:
        return EagleHeadConfig(
            kind=kind, hidden_size=hidden, intermediate_size=inter, num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads), vocab_size=vocab,
            draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab) if kind is HeadKind.EAGLE3 else vocab,
            target_hidden_size=target_hidden, target_num_layers=target_cfg.num_layers,
            aux_layer_ids=tuple(int(i) for i in ids), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)), rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            attention_bias=bool(cfg.get("attention_bias", False)), fc_bias=has_fc_bias,
            fc_norm=bool(cfg.get("fc_norm", False)), norm_output=bool(cfg.get("norm_output", False)),
            own_embedding=has_embedding)
    except ValueError as e:
        raise CheckpointError(str(e)) from e


def _check_json_arch(cfg: dict, kind: HeadKind) -> None:
    if cfg.get("model_type", "llama") != "llama":
        raise CheckpointError(f"head model_type {cfg.get('model_type')!r} is not supported (llama is)")
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise CheckpointError(f"EAGLE heads have one decoder layer; config says num_hidden_layers="
                              f"{cfg.get('num_hidden_layers')}")
    archs = cfg.get("architectures") or []
    if kind is HeadKind.EAGLE3 and archs and not set(archs) & set(EAGLE3_ARCHITECTURES):
        raise CheckpointError(f"architectures {archs} is not an EAGLE-3 head ({list(EAGLE3_ARCHITECTURES)})")


# -- EAGLE load / save ---------------------------------------------------------------------------
def load_eagle_head(path: str | Path, target_model, kind: HeadKind,
                    aux_layer_ids: tuple[int, ...] | None = None) -> EagleHead:
    """Load an EAGLE-1 or EAGLE-3 head for ``target_model`` (our ``Transformer``)."""
    folder = Path(path)
    cfg_json = read_config(folder)
    state = _normalise_names(read_tensors(folder), kind)
    cfg = eagle_config_from_json(cfg_json, target_model.cfg, kind, "embed_tokens.weight" in state,
                                 "fc.bias" in state, aux_layer_ids)
    head = new_eagle_head(cfg, target_model)
    names = _eagle_names(cfg)
    if kind is HeadKind.EAGLE3 and "d2t" not in state and cfg.draft_vocab_size == cfg.vocab_size:
        state["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)      # full vocabulary: identity
    _check_names(state, names)
    if kind is HeadKind.EAGLE3:
        _check_vocab_maps(state, cfg)
    ours = {names[k]: v for k, v in state.items()}
    _load_into(head, ours, {v: k for k, v in names.items()})
    return head.eval().requires_grad_(False)


def new_eagle_head(cfg: EagleHeadConfig, target_model) -> EagleHead:
    """A freshly initialised head in the target's dtype, sharing what the config says to share."""
    dtype = next(target_model.parameters()).dtype
    embed = None if cfg.own_embedding else target_model.embed.weight.detach()
    if cfg.kind is HeadKind.EAGLE3:
        head = Eagle3Head(cfg, embed)
    else:
        head = Eagle1Head(cfg, embed, target_model.lm_head.weight.detach())
    return head.to(dtype)


def _check_names(state: dict, names: dict[str, str]) -> None:
    unknown = sorted(set(state) - set(names))
    missing = sorted(set(names) - set(state) - {"t2d"})
    if unknown:
        raise CheckpointError(f"unknown tensors in checkpoint: {unknown[:6]}")
    if missing:
        raise CheckpointError(f"checkpoint is missing tensors: {missing[:6]}")


def _check_vocab_maps(state: dict, cfg: EagleHeadConfig) -> None:
    """``d2t`` [draft_vocab] int offsets onto distinct target ids; ``t2d`` [vocab] bool agrees."""
    d2t = state["d2t"]
    if tuple(d2t.shape) != (cfg.draft_vocab_size,) or d2t.dtype.is_floating_point:
        raise CheckpointError(f"d2t must be an integer tensor [{cfg.draft_vocab_size}] (draft_vocab_size), "
                              f"got {d2t.dtype} {tuple(d2t.shape)}")
    try:
        t2d = DraftVocab.from_ids(torch.arange(cfg.draft_vocab_size) + d2t.long(), cfg.vocab_size).t2d
    except ValueError:
        raise CheckpointError("d2t maps draft ids outside the target vocabulary or onto repeated ids") from None
    if "t2d" in state:
        given = state["t2d"]
        if tuple(given.shape) != (cfg.vocab_size,) or not torch.equal(given.bool(), t2d):
            raise CheckpointError("t2d does not mark exactly the target ids that d2t maps to")
    state["t2d"] = t2d


def _load_into(module: nn.Module, ours: dict[str, torch.Tensor], official: dict[str, str]) -> None:
    own = dict(module.named_parameters()) | dict(module.named_buffers())
    for name, t in ours.items():
        dst = own[name]
        if tuple(t.shape) != tuple(dst.shape):
            raise CheckpointError(f"tensor {official.get(name, name)}: checkpoint shape {tuple(t.shape)}, "
                                  f"config.json implies {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(t.to(dst.dtype))


def save_eagle_head(head: EagleHead, path: str | Path, weights: str = "model.safetensors") -> Path:
    """Write ``head`` with the official names (what SpecForge exports and vLLM / SGLang read)."""
    folder = Path(path)
    cfg = head.cfg
    names = _eagle_names(cfg)
    own = dict(head.named_parameters()) | dict(head.named_buffers())
    write_tensors(folder, {theirs: own[ours] for theirs, ours in names.items()}, weights)
    write_config(folder, eagle_config_to_json(cfg, own["fc.weight"].dtype))
    return folder


def eagle_config_to_json(cfg: EagleHeadConfig, dtype: torch.dtype) -> dict:
    out = {
        "architectures": ["LlamaForCausalLMEagle3" if cfg.kind is HeadKind.EAGLE3 else "LlamaForCausalLM"],
        "model_type": "llama", "hidden_act": "silu", "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling, "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias, "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."), "target_hidden_size": cfg.target_hidden_size,
    }
    if cfg.kind is HeadKind.EAGLE3:
        out.update({"draft_vocab_size": cfg.draft_vocab_size, "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output,
                    "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
                                     "use_aux_hidden_state": True}})
    else:
        out["bias"] = cfg.fc_bias
    return out


# -- Medusa ------------------------------------------------------------------------------------
class MedusaLayout(str, enum.Enum):
    FASTER_DECODING = "faster_decoding"   # medusa_lm_head.safetensors, {i}.{j}.linear.*, {i}.{K}.weight
    VLLM = "vllm"                         # model.safetensors, blocks.{i}.layers.{j}.*, lm_heads.{i}.weight


MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "model.safetensors", "pytorch_model.bin")
_FD_BLOCK = re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)")
_FD_HEAD = re.compile(r"(\d+)\.(\d+)\.weight")


def _medusa_config(cfg: dict, target_cfg, tied: bool, bias: bool) -> MedusaConfig:
    heads = cfg.get("medusa_num_heads", cfg.get("num_heads"))
    layers = cfg.get("medusa_num_layers", cfg.get("num_hidden_layers"))
    if heads is None or layers is None:
        raise CheckpointError("Medusa config.json needs medusa_num_heads and medusa_num_layers "
                              "(or vLLM's num_heads and num_hidden_layers)")
    for key, want in (("hidden_size", target_cfg.hidden_size), ("vocab_size", target_cfg.vocab_size),
                      ("truncated_vocab_size", target_cfg.vocab_size)):
        if cfg.get(key) is not None and int(cfg[key]) != want:
            raise CheckpointError(f"Medusa {key} {cfg[key]} differs from the target's {want}")
    try:
        return MedusaConfig(int(heads), int(layers), target_cfg.hidden_size, target_cfg.vocab_size,
                            tied_lm_head=tied, block_bias=bias)
    except ValueError as e:
        raise CheckpointError(str(e)) from e


def _medusa_to_ours(state: dict[str, torch.Tensor], k_layers: int) -> dict[str, torch.Tensor]:
    """FasterDecoding or vLLM names -> ours (vLLM's); unknown names raise."""
    out, unknown = {}, []
    for name, t in state.items():
        name = name[len("model."):] if name.startswith("model.") else name
        fd_block, fd_head = _FD_BLOCK.fullmatch(name), _FD_HEAD.fullmatch(name)
        if fd_block:
            i, j, kind = fd_block.groups()
            out[f"blocks.{i}.layers.{j}.{kind}"] = t
        elif fd_head and int(fd_head.group(2)) == k_layers:
            out[f"lm_heads.{fd_head.group(1)}.weight"] = t
        elif re.fullmatch(r"blocks\.\d+\.layers\.\d+\.(weight|bias)|lm_heads\.\d+\.weight", name):
            out[name] = t
        else:
            unknown.append(name)
    if unknown:
        raise CheckpointError(f"unknown tensors in Medusa checkpoint: {sorted(unknown)[:6]}")
    return out


def load_medusa_heads(path: str | Path, target_model) -> MedusaHeads:
    folder = Path(path)
    cfg_json = read_config(folder)
    layers = int(cfg_json.get("medusa_num_layers", cfg_json.get("num_hidden_layers", 1)))
    state = _medusa_to_ours(read_tensors(folder, MEDUSA_FILES), layers)
    tied = bool(cfg_json.get("tie_lm_head", False))
    bias = any(n.endswith(".bias") for n in state)
    cfg = _medusa_config(cfg_json, target_model.cfg, tied, bias)
    heads = MedusaHeads(cfg, target_model.lm_head.weight.detach() if tied else None)
    expected = set(heads.state_dict())
    missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
    if unknown:
        raise CheckpointError(f"tensors beyond the config's {cfg.num_heads} heads x {cfg.num_layers} layers"
                              f"{' (tied lm_head)' if tied else ''}: {unknown[:6]}")
    if missing:
        raise CheckpointError(f"Medusa checkpoint is missing tensors: {missing[:6]}")
    _load_into(heads, state, {})
    return heads.to(next(target_model.parameters()).dtype).eval().requires_grad_(False)


def save_medusa_heads(heads: MedusaHeads, path: str | Path,
                      layout: MedusaLayout = MedusaLayout.FASTER_DECODING) -> Path:
    """Write ``heads`` in FasterDecoding's layout (default) or vLLM's."""
    folder = Path(path)
    cfg = heads.cfg
    state = heads.state_dict()
    base = {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "tie_lm_head": cfg.tied_lm_head}
    if MedusaLayout(layout) is MedusaLayout.VLLM:
        write_tensors(folder, state, "model.safetensors")
        write_config(folder, base | {"architectures": ["MedusaModel"], "model_type": "medusa",
                                     "num_heads": cfg.num_heads, "num_hidden_layers": cfg.num_layers,
                                     "medusa_fc_bias": cfg.block_bias})
        return folder
    fd = {}
    for name, t in state.items():
        m = re.fullmatch(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)", name)
        fd[f"{m.group(1)}.{m.group(2)}.linear.{m.group(3)}" if m else
           f"{name.split('.')[1]}.{cfg.num_layers}.weight"] = t
    write_tensors(folder, fd, "medusa_lm_head.safetensors")
    write_config(folder, base | {"medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers})
    return folder
