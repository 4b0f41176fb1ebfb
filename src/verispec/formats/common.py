"""What every head format shares: ``CheckpointError``, the consumers an export targets, reading and
writing ``config.json`` and weight files, and the name / shape checks each reader makes.

Weight files: ``*.safetensors`` (read with safetensors) or a ``torch.save`` dict (``.bin`` /
``.pt``, read with ``weights_only=True``). Any unreadable or truncated file is a
``CheckpointError`` naming the file; so is a missing or invalid ``config.json``.
"""
from __future__ import annotations

import enum
import json
from pathlib import Path

import torch
from torch import nn

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


class CheckpointError(ValueError):
    """A head checkpoint that does not fit the target or is malformed; the message says which."""


class ExportFormat(str, enum.Enum):
    """The consumer an export is written for (``verispec export --format``)."""
    EAGLE = "eagle"       # SafeAILab/EAGLE EaModel (EAGLE-1 and EAGLE-3 heads)
    SGLANG = "sglang"     # SGLang LlamaForCausalLMEagle / LlamaForCausalLMEagle3
    VLLM = "vllm"         # vLLM EagleLlamaForCausalLM / Eagle3LlamaForCausalLM / MedusaModel
    MEDUSA = "medusa"     # FasterDecoding Medusa (medusa_lm_head.pt / .safetensors)


CONSUMER = {ExportFormat.EAGLE: "the EAGLE repo", ExportFormat.SGLANG: "SGLang", ExportFormat.VLLM: "vLLM",
            ExportFormat.MEDUSA: "FasterDecoding Medusa"}


# -- files ---------------------------------------------------------------------------------------------
def read_config(folder: Path) -> dict:
    """``folder/config.json`` as a dict."""
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise CheckpointError(f"{folder} is not a folder")
    if not path.exists():
        raise CheckpointError(f"{folder} has no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def read_tensors(folder: Path, names: tuple[str, ...] = WEIGHT_FILES) -> dict[str, torch.Tensor]:
    """Tensors of the first of ``names`` found in ``folder`` (else of every ``*.safetensors`` shard)."""
    folder = Path(folder)
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
    """Write ``tensors`` (contiguous CPU copies) as safetensors, or with ``torch.save`` for other names."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    if name.endswith(".safetensors"):
        from safetensors.torch import save_file
        save_file(tensors, str(folder / name))
    else:
        torch.save(tensors, str(folder / name))


def write_config(folder: Path, cfg: dict) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# -- checks --------------------------------------------------------------------------------------------
def strip_model_prefix(name: str) -> str:
    """Checkpoints written from a wrapping module carry a leading ``model.``; names are read without it."""
    return name[len("model."):] if name.startswith("model.") else name


def check_names(state: dict, expected: set[str], optional: set[str] = frozenset(), what: str = "checkpoint") -> None:
    """``state`` holds exactly ``expected`` (``optional`` names may be absent)."""
    unknown = sorted(set(state) - expected)
    missing = sorted(expected - set(state) - optional)
    if unknown:
        raise CheckpointError(f"unknown tensors in {what}: {unknown[:6]}")
    if missing:
        raise CheckpointError(f"{what} is missing tensors: {missing[:6]}")


def module_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Shapes of every parameter and buffer of ``module`` (build it on the meta device: no memory)."""
    own = dict(module.named_parameters()) | dict(module.named_buffers())
    return {k: tuple(v.shape) for k, v in own.items()}


def check_shapes(state: dict[str, torch.Tensor], want: dict[str, tuple[int, ...]],
                 shown: dict[str, str] | None = None) -> None:
    """Each tensor of ``state`` has the shape ``want`` names for it (``shown``: names for messages)."""
    for name, t in state.items():
        if name in want and tuple(t.shape) != want[name]:
            label = (shown or {}).get(name, name)
            raise CheckpointError(f"tensor {label}: checkpoint shape {tuple(t.shape)}, "
                                  f"config.json implies {want[name]}")


def copy_into(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (our parameter / buffer names, shapes already checked) into ``module``."""
    own = dict(module.named_parameters()) | dict(module.named_buffers())
    with torch.no_grad():
        for name, t in state.items():
            own[name].copy_(t.to(own[name].dtype))


def dtype_of(tensors: dict[str, torch.Tensor], first: str) -> torch.dtype:
    """The floating dtype of ``tensors[first]`` (else of the first floating tensor; else float32)."""
    if first in tensors and tensors[first].is_floating_point():
        return tensors[first].dtype
    return next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
