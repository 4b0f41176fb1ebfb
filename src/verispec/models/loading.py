"""Build a ready ``Transformer`` (and its tokenizer) from a model argument.

A model argument is a known name (see ``sources``), a ``.gguf`` file or a Hugging Face folder.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from .auto_weights import AUTO, auto_weights
from .device import device_type, resolve_device
from .config import ModelConfig
from .packed import WeightFormat
from .transformer import Transformer

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


@dataclass
class LoadedModel:
    name: str
    path: Path
    format: str            # "gguf" | "hf"
    config: ModelConfig
    model: Transformer
    tokenizer: object      # a transformers PreTrainedTokenizer(Fast)
    weights: WeightFormat = WeightFormat.DENSE


def build_transformer(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                      device: str | torch.device = "cpu") -> Transformer:
    """Instantiate without initialising random weights, directly in ``dtype`` on ``device`` (no
    fp32 copy on the device first), then load ``state`` strictly. The numbers are those of loading
    in fp32 and casting to ``dtype`` (RoPE buffers included).
    ``state`` is consumed (emptied): on the CPU the model takes its tensors over instead of copying
    them, and fusing frees each layer's parts as it goes, so loading peaks at about one copy of the
    weights (a 1.5B model: 6 GB, not 12)."""
    with torch.device("meta"):
        model = Transformer(cfg).to(dtype)
    model = model.to_empty(device=device)
    model.reset_rope_(device)
    expected = set(model.state_dict().keys())
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing = sorted(expected - set(state))
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")
    for name, param in model.state_dict().items():
        if name in state and tuple(state[name].shape) != tuple(param.shape):
            raise ValueError(f"tensor {name}: checkpoint shape {tuple(state[name].shape)}, "
                             f"model expects {tuple(param.shape)}")
    take = device_type(device) == "cpu"
    model.load_state_dict(state, strict=False, assign=take)
    state.clear()       # the model holds the only reference now (or a copy on another device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.to(dtype).eval().requires_grad_(False).fuse_()


def check_weights(weights: str | WeightFormat, dtype: str | torch.dtype,
                  device: str | torch.device | None = "cpu") -> WeightFormat:
    """The weight format, refused for a dtype or device it cannot serve: fp16 packing (FBGEMM) and
    int4 packing take fp32 models on the CPU. Checks the device's kind only (no GPU needed to be
    told)."""
    weights = WeightFormat.parse(weights)
    if weights is WeightFormat.DENSE:
        return weights
    what = {WeightFormat.FP16: "FBGEMM fp16 packing", WeightFormat.INT4: "int4 weight-only packing",
            WeightFormat.INT4_ALL: "int4 weight-only packing", WeightFormat.INT8: "int8 W8A8 packing",
            WeightFormat.INT4_HEAD8: "int4 weight-only packing with an int8 W8A8 LM head",
            WeightFormat.INT4_A8: "int4 W4A8 packing with an int8 W8A8 LM head"}[weights]
    kind = device_type(device)
    if kind != "cpu":
        raise ValueError(f"weights={weights.value!r} ({what}) runs on the CPU only, not on {kind!r}; "
                         "on CUDA use dtype bfloat16 or float16 with weights='dense' (the fast path there)")
    if parse_dtype(dtype) != torch.float32:
        raise ValueError(f"weights={weights.value!r} packs fp32 models (activations stay fp32); use dtype float32")
    if weights is WeightFormat.INT4_A8:
        from .int4 import kernel, unavailable_reason as int4_reason
        if kernel() is None:
            raise ValueError(f"weights={weights.value!r} needs verispec's int4 kernel: {int4_reason()}")
    elif weights.int4_layers:
        from .int4 import int4_available
        if not int4_available():
            raise ValueError(f"weights={weights.value!r} needs verispec's int4 kernel or PyTorch's CPU int4pack "
                             "kernel, and this machine has neither")
    if weights.int8_activations:
        from .int8 import int8_available, unavailable_reason
        if not int8_available():
            raise ValueError(f"weights={weights.value!r} needs verispec's int8 kernel: {unavailable_reason()}")
    return weights


def read_config(path: Path, fmt: str) -> ModelConfig:
    """The model's config alone (no weights read): GGUF metadata or an HF folder's config.json."""
    if fmt == "gguf":
        import gguf
        from .gguf_loader import config_from_gguf
        return config_from_gguf(gguf.GGUFReader(str(path)))
    import json
    return ModelConfig.from_hf(json.loads((Path(path) / "config.json").read_text()))


def load_tokenizer(path: Path, fmt: str):
    """Tokenizer and chat template through transformers. Building one from GGUF metadata takes
    seconds, so the result is saved once under the cache folder, keyed by file size and mtime."""
    from transformers import AutoTokenizer
    import transformers.utils.logging as hf_logging
    from .sources import cache_dir
    hf_logging.set_verbosity_error()
    if fmt != "gguf":
        return AutoTokenizer.from_pretrained(str(path))
    st = path.stat()
    saved = cache_dir() / "tokenizers" / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}"
    if (saved / "tokenizer_config.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(saved))
        except Exception:  # noqa: BLE001 - a broken cache entry is rebuilt below
            pass
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        tmp = saved.with_name(saved.name + f".tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        os.replace(tmp, saved) if not saved.exists() else shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass   # read-only cache: the tokenizer still works, it is just rebuilt next time
    return tok


def load_model(model: str | Path, dtype: str | torch.dtype = "float32",
               with_tokenizer: bool = True, weights: str | WeightFormat = "dense",
               device: str | torch.device | None = "cpu") -> LoadedModel:
    """Resolve ``model`` (known name, GGUF file or HF folder) and load weights and tokenizer.
    ``weights="fp16"``: fp16-packed matmul weights for CPU inference (``packed``; fp32 only);
    ``weights="int4"``: int4 weight-only decoder layers, fp16-packed LM head (``int4``);
    ``weights="int4-all"``: int4 in the LM head too; ``weights="int4-head8"``: an int8 W8A8 LM head;
    ``weights="int4-a8"``: that head, and int8 activations per group of 32 in the decoder layers;
    ``weights="int8"``: int8 weights x per-token int8 activations in the decoder layers (``int8``);
    ``weights="auto"``: the fastest weights faithful to the checkpoint (``auto_weights``: int4 for
    a 4-bit GGUF, else fp16 packing, dense off the CPU or for another dtype than float32).
    ``device``: where the weights live (``device.resolve_device``: cpu, auto, cuda, cuda:N...)."""
    from .gguf_loader import load_gguf
    from .hf_loader import load_hf_folder
    from .sources import resolve_model
    if weights != AUTO:                 # refused before anything is resolved or loaded
        weights = check_weights(weights, dtype, device)
    src = resolve_model(model)
    if weights == AUTO:
        weights = check_weights(auto_weights(src.path, src.format, parse_dtype(dtype), device_type(device)),
                                dtype, device)
    dev = resolve_device(device)
    cfg, state = load_gguf(src.path) if src.format == "gguf" else load_hf_folder(src.path)
    net = build_transformer(cfg, state, parse_dtype(dtype), dev)
    if weights is WeightFormat.FP16:
        net.pack_fp16_()
    elif weights.int4_layers:
        net.pack_int4_(head={WeightFormat.INT4_ALL: "int4", WeightFormat.INT4_HEAD8: "int8",
                             WeightFormat.INT4_A8: "int8"}.get(weights, "fp16"),
                       int8_activations=weights is WeightFormat.INT4_A8)
    elif weights is WeightFormat.INT8:
        net.pack_int8_()
    tok = load_tokenizer(src.path, src.format) if with_tokenizer else None
    return LoadedModel(name=src.name, path=src.path, format=src.format, config=cfg, model=net, tokenizer=tok,
                       weights=weights)
