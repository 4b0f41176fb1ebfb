"""Where tensors live: one helper turns a device argument into a ``torch.device``.

A device argument (``LLM(device=...)``, ``--device``) is
- ``"cpu"`` (the default everywhere);
- ``"auto"``: ``"cuda"`` when ``torch.cuda.is_available()``, else ``"cpu"``;
- any torch device string or ``torch.device``: ``"cuda"``, ``"cuda:1"``, ``"mps"``, ...

``resolve_device`` raises a ValueError that names the problem for a string torch does not know and
for a CUDA device asked for without CUDA (or with an index past the visible GPUs). Every tensor the
engine, its drafters, the logits pipeline and the trainers make is created on the resolved device;
the fp16-packed weights (``models.packed``) are the one CPU-only option. Knows nothing else.
"""
from __future__ import annotations

import torch

DEVICE_HELP = ("where the model and every tensor live: cpu (default), auto (cuda when available), "
               "cuda, cuda:N or any torch device")


def resolve_device(spec: str | torch.device | None = "cpu") -> torch.device:
    """The ``torch.device`` of a device argument (None = ``"cpu"``); see the module docstring."""
    if spec is None:
        return torch.device("cpu")
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec.strip() if isinstance(spec, str) else spec)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"unknown device {spec!r} ({e}); use cpu, auto, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r} asked for, but CUDA is not available (torch {torch.__version__}, "
                             "no GPU or a CPU-only build); use device 'cpu' or 'auto'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ValueError(f"device {spec!r} asked for, but MPS is not available; use device 'cpu' or 'auto'")
    return dev


def device_type(spec: str | torch.device | None) -> str:
    """The kind of device a spec names (``"cpu"``, ``"cuda"``, ...) without checking that it is
    there: for argument checks that must not depend on the machine (``"auto"`` is resolved)."""
    if spec is None:
        return "cpu"
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        return resolve_device(spec).type
    try:
        return torch.device(spec.strip() if isinstance(spec, str) else spec).type
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"unknown device {spec!r} ({e}); use cpu, auto, cuda or cuda:N") from None


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of a module's first parameter (or buffer); cpu for a module with neither."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def _device_arg(text: str) -> str:
    """argparse type of ``--device``: the spelling is checked here, availability at load time."""
    import argparse
    try:
        device_type(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one: same type, and same index where both name one ("cuda" is the
    current CUDA device, which tensors report as "cuda:N")."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def add_device_argument(parser, default: str = "cpu") -> None:
    """``--device`` on an argparse parser (the same flag on every command)."""
    parser.add_argument("--device", type=_device_arg, default=default, help=f"{DEVICE_HELP} (default: %(default)s)")


WEIGHTS_HELP = ("matmul weights on the CPU: auto (the fastest faithful to the checkpoint: int4 for a 4-bit "
                "GGUF, else fp16; dense on CUDA or for a dtype other than float32), dense (as loaded), fp16 (FBGEMM fp16-packed, fp32 activations: "
                "faster, not bit-equal to fp32), int4 (int4 weight-only decoder layers with bf16 activations, "
                "fp16-packed LM head: fewest bytes; a GGUF's 4-bit blocks are kept as they are), int4-all "
                "(int4 in the LM head too: fewer bytes again, at a quality cost), int4-head8 (an int8 W8A8 LM head: "
                "half the fp16 head's bytes, a smaller quality cost than int4-all's), int4-a8 (int4-head8 with the "
                "decoder layers' activations in int8 per group of 32, as llama.cpp's Q4 x Q8: the fastest on "
                "AVX-512 VNNI) or int8 (int8 weights x "
                "per-token int8 activations in the decoder layers: a faster one-token decode than fp16)")


def add_weights_argument(parser, default: str | None = "auto", extra: str = "") -> None:
    """The ``--weights`` option of every command that loads a target (``models.packed.WeightFormat``,
    or ``auto``: ``models.auto_weights``)."""
    from .auto_weights import AUTO
    from .packed import WeightFormat
    parser.add_argument("--weights", choices=[AUTO] + [w.value for w in WeightFormat], default=default,
                        help=WEIGHTS_HELP + (extra or "; default %(default)s"))
