"""Medusa heads: read and write FasterDecoding's layout and vLLM's.

FasterDecoding (``MedusaLayout.FASTER_DECODING``, our default): ``medusa_lm_head.safetensors`` (or
``medusa_lm_head.pt``) with ``{i}.{j}.linear.weight`` / ``.bias`` for block j of head i and
``{i}.{K}.weight`` for its vocabulary projection (K = ``medusa_num_layers``), config keys
``medusa_num_heads`` / ``medusa_num_layers``. vLLM (``MedusaLayout.VLLM``): ``model.safetensors``
with ``blocks.{i}.layers.{j}.weight`` / ``.bias`` (our parameter names) and ``lm_heads.{i}.weight``,
config ``num_heads`` / ``num_hidden_layers``. A missing vocabulary projection is an error unless the
config says ``tie_lm_head: true`` (our extension: heads use the target's lm_head). Leading
``model.`` prefixes are accepted on load; every mismatch raises ``CheckpointError``.

Consumer layouts (``to_consumer``): ``medusa`` (FasterDecoding ``MedusaModel.from_pretrained``,
which reads only ``medusa_lm_head.pt``; TGI and the newer training scripts use
``medusa_lm_head.safetensors``: both files are written, the same tensors; biases always, one copy
of the target's lm_head per head for tied heads) and ``vllm`` (``truncated_vocab_size``; tied heads
as one ``lm_heads.0.weight`` with ``original_lm_head: true``, which ``load_medusa_heads`` does not
read back).
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from ..drafting.medusa_head import MedusaConfig, MedusaHeads
from .common import (CONSUMER, CheckpointError, ExportFormat, check_shapes, copy_into, dtype_name, dtype_of,
                     module_shapes, read_config, read_tensors, strip_model_prefix, write_config, write_tensors)


class MedusaLayout(str, enum.Enum):
    FASTER_DECODING = "faster_decoding"   # medusa_lm_head.safetensors, {i}.{j}.linear.*, {i}.{K}.weight
    VLLM = "vllm"                         # model.safetensors, blocks.{i}.layers.{j}.*, lm_heads.{i}.weight


FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "model.safetensors", "pytorch_model.bin")
_FD_BLOCK = re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)")
_FD_HEAD = re.compile(r"(\d+)\.(\d+)\.weight")
_OURS_BLOCK = re.compile(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)")


@dataclass
class MedusaCheckpoint:
    """Validated heads: our config and their tensors under our (vLLM's) names."""
    cfg: MedusaConfig
    tensors: dict[str, torch.Tensor]


# -- names and config ------------------------------------------------------------------------------
def config_from_json(cfg: dict, target_cfg, tied: bool, bias: bool) -> MedusaConfig:
    """Our ``MedusaConfig`` from FasterDecoding's or vLLM's config keys, checked against the target's."""
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


def to_ours(state: dict[str, torch.Tensor], k_layers: int) -> dict[str, torch.Tensor]:
    """FasterDecoding or vLLM names -> ours (vLLM's); unknown names raise."""
    out, unknown = {}, []
    for name, t in state.items():
        name = strip_model_prefix(name)
        fd_block, fd_head = _FD_BLOCK.fullmatch(name), _FD_HEAD.fullmatch(name)
        if fd_block:
            i, j, kind = fd_block.groups()
            out[f"blocks.{i}.layers.{j}.{kind}"] = t
        elif fd_head and int(fd_head.group(2)) == k_layers:
            out[f"lm_heads.{fd_head.group(1)}.weight"] = t
        elif _OURS_BLOCK.fullmatch(name) or re.fullmatch(r"lm_heads\.\d+\.weight", name):
            out[name] = t
        else:
            unknown.append(name)
    if unknown:
        raise CheckpointError(f"unknown tensors in Medusa checkpoint: {sorted(unknown)[:6]}")
    return out


def faster_decoding_names(state: dict[str, torch.Tensor], k_layers: int) -> dict[str, torch.Tensor]:
    """Ours -> FasterDecoding's (``blocks.{i}.layers.{j}.*`` -> ``{i}.{j}.linear.*``,
    ``lm_heads.{i}.weight`` -> ``{i}.{K}.weight``)."""
    out = {}
    for name, t in state.items():
        m = _OURS_BLOCK.fullmatch(name)
        out[f"{m.group(1)}.{m.group(2)}.linear.{m.group(3)}" if m else f"{name.split('.')[1]}.{k_layers}.weight"] = t
    return out


# -- read / load / save ------------------------------------------------------------------------------
def read(folder: str | Path, target_cfg=None) -> MedusaCheckpoint:
    """The validated heads in ``folder`` for a target with config ``target_cfg`` (None: hidden and
    vocabulary sizes come from the heads' config or tensors)."""
    folder = Path(folder)
    cfg_json = read_config(folder)
    layers = int(cfg_json.get("medusa_num_layers", cfg_json.get("num_hidden_layers", 1)))
    state = to_ours(read_tensors(folder, FILES), layers)
    tied = bool(cfg_json.get("tie_lm_head", False))
    cfg = config_from_json(cfg_json, target_cfg or _standin_target(cfg_json, state), tied,
                           any(n.endswith(".bias") for n in state))
    with torch.device("meta"):
        shapes = module_shapes(MedusaHeads(cfg, torch.empty(cfg.vocab_size, cfg.hidden_size) if tied else None))
    shapes.pop("target_lm_head", None)
    missing, unknown = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
    if unknown:
        raise CheckpointError(f"tensors beyond the config's {cfg.num_heads} heads x {cfg.num_layers} layers"
                              f"{' (tied lm_head)' if tied else ''}: {unknown[:6]}")
    if missing:
        raise CheckpointError(f"Medusa checkpoint is missing tensors: {missing[:6]}")
    check_shapes(state, shapes)
    return MedusaCheckpoint(cfg, state)


def _standin_target(cfg_json: dict, state: dict[str, torch.Tensor]) -> SimpleNamespace:
    w = state.get("blocks.0.layers.0.weight", state.get("lm_heads.0.weight"))
    hidden = cfg_json.get("hidden_size") or (w.shape[-1] if w is not None else None)
    vocab = cfg_json.get("vocab_size") or (state["lm_heads.0.weight"].shape[0] if "lm_heads.0.weight" in state
                                           else None)
    if hidden is None or vocab is None:
        raise CheckpointError("cannot tell the Medusa heads' hidden / vocabulary size; pass the target model")
    return SimpleNamespace(hidden_size=int(hidden), vocab_size=int(vocab))


def load_medusa_heads(path: str | Path, target_model) -> MedusaHeads:
    """The Medusa heads in ``path`` (either layout) for ``target_model``, eval, no gradients, on
    the target's device."""
    ck = read(path, target_model.cfg)
    heads = MedusaHeads(ck.cfg, target_model.lm_head.weight.detach() if ck.cfg.tied_lm_head else None)
    copy_into(heads, ck.tensors)
    first = next(target_model.parameters())          # on the target's device, in its dtype
    return heads.to(first.device, first.dtype).eval().requires_grad_(False)


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
    write_tensors(folder, faster_decoding_names(state, cfg.num_layers), "medusa_lm_head.safetensors")
    write_config(folder, base | {"medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers})
    return folder


# -- consumers ---------------------------------------------------------------------------------------
def _target_lm_head(cfg: MedusaConfig, target_model, dtype: torch.dtype, fmt: ExportFormat) -> torch.Tensor:
    if target_model is None:
        raise CheckpointError(f"the Medusa heads are tied to the target's lm_head and {CONSUMER[fmt]} has no "
                              "such tie: pass the target model (--target) so its lm_head can be copied in")
    w = target_model.lm_head.weight.detach()
    if tuple(w.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise CheckpointError(f"target lm_head shape {tuple(w.shape)} does not fit the heads "
                              f"({cfg.vocab_size}, {cfg.hidden_size})")
    return w.to(dtype).cpu().clone()


def to_consumer(ck: MedusaCheckpoint, fmt: ExportFormat, target_model, base_model: str | None, notes: list[str]):
    """``(config.json, tensors, weight file names)`` of ``ck`` for ``medusa`` (FasterDecoding) or ``vllm``."""
    cfg, state = ck.cfg, ck.tensors
    dtype = dtype_of(state, "blocks.0.layers.0.weight")
    if fmt is ExportFormat.VLLM:
        out = dict(state)
        out_cfg = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": cfg.hidden_size,
                   "vocab_size": cfg.vocab_size, "truncated_vocab_size": cfg.vocab_size, "num_heads": cfg.num_heads,
                   "num_hidden_layers": cfg.num_layers, "medusa_fc_bias": cfg.block_bias,
                   "torch_dtype": dtype_name(dtype)}
        if cfg.tied_lm_head:
            out["lm_heads.0.weight"] = _target_lm_head(cfg, target_model, dtype, fmt)
            out_cfg["original_lm_head"] = True
            notes.append("tied heads: wrote the target's lm_head once as lm_heads.0.weight with "
                         "original_lm_head: true (vLLM shares it across heads)")
        return out_cfg, out, ("model.safetensors",)
    out = dict(state)
    if not cfg.block_bias:
        out |= {n.replace(".weight", ".bias"): torch.zeros(cfg.hidden_size, dtype=t.dtype)
                for n, t in state.items() if _OURS_BLOCK.fullmatch(n)}
        if cfg.num_layers:
            notes.append("FasterDecoding's ResBlock always has a bias: wrote zero biases (same function)")
    if cfg.tied_lm_head:
        out |= {f"lm_heads.{i}.weight": _target_lm_head(cfg, target_model, dtype, fmt) for i in range(cfg.num_heads)}
        notes.append(f"tied heads: wrote one copy of the target's lm_head per head ({cfg.num_heads} copies)")
    _note_distinct_blocks(cfg, state, notes)
    out_cfg = {"medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
               "vocab_size": cfg.vocab_size, "tie_lm_head": False, "torch_dtype": dtype_name(dtype)}
    if base_model:
        out_cfg["base_model_name_or_path"] = base_model
    else:
        notes.append("base_model_name_or_path not written (pass base_model / --base-model): FasterDecoding "
                     "then defaults to lmsys/vicuna-7b-v1.3 unless from_pretrained gets base_model=")
    return out_cfg, faster_decoding_names(out, cfg.num_layers), ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


def _note_distinct_blocks(cfg: MedusaConfig, state: dict[str, torch.Tensor], notes: list[str]) -> None:
    k = cfg.num_layers
    if k > 1 and any(not torch.equal(state[f"blocks.{i}.layers.0.weight"], state[f"blocks.{i}.layers.{j}.weight"])
                     for i in range(cfg.num_heads) for j in range(1, k)):
        notes.append(f"{k} distinct blocks per head: FasterDecoding's MedusaModel builds "
                     "[ResBlock] * medusa_num_layers (one shared block per head) and keeps only one of them; "
                     "TGI / TensorRT-LLM read every block")
