"""A guard that proves on a CPU that nothing silently falls back to CPU tensors.

On a CPU every tensor is on the "right" device, so a forgotten ``device=`` only shows on a GPU.
The guard makes it show here: ``FactoryDeviceGuard`` is a ``TorchFunctionMode`` that sees every
torch call made while it is active and records each *tensor factory* call (``torch.zeros``,
``torch.tensor``, ``torch.arange``, ``torch.rand`` ..., the list torch's own default-device
context uses) that
- has no ``device`` argument (or ``device=None``), and
- is made from a source file under one of ``roots`` (default: the ``verispec`` package), the first
  frame outside torch's own files counting (so ``nn.Linear(...)`` built in verispec code counts).
Such a call makes a CPU tensor whatever device the engine runs on. A deliberate host tensor says so
with ``device="cpu"`` and is not recorded. ``torch.tensor`` / ``torch.as_tensor`` of a tensor (a
view or copy of it, on its device) and calls inside an explicit ``with torch.device(...)`` are not
recorded either.

Evaluated and not chosen: ``torch.set_default_device("meta")`` during decoding. It turns every
device-less factory into a meta tensor, but the failure comes later and elsewhere (``.tolist()``,
``int()`` or a mixed-device op far from the cause), and it also changes tensors made by other
libraries on the way (tokenizers, llguidance), so it cannot tell verispec's bugs from theirs.

Use::

    with FactoryDeviceGuard() as guard:
        llm.generate(...)
    assert not guard.findings, guard.report()

The guard is thread-local (torch's mode stack is): it sees the calling thread only.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

FACTORIES = frozenset(_device_constructors())
_WRAPPERS = frozenset({torch.tensor, torch.as_tensor, torch.asarray})
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS = os.path.abspath(__file__)


def package_root() -> str:
    import verispec
    return os.path.dirname(os.path.abspath(verispec.__file__)) + os.sep


@dataclass(frozen=True)
class Finding:
    """A device-less factory call: ``factory`` called at ``file:line`` in ``function``."""
    factory: str
    file: str           # relative to the root it was found under (e.g. "logits.py", "drafters/eagle.py")
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}(): torch.{self.factory} without device="


class FactoryDeviceGuard(TorchFunctionMode):
    def __init__(self, roots: tuple[str, ...] | None = None):
        super().__init__()
        self.roots = tuple(os.path.abspath(r).rstrip(os.sep) + os.sep for r in roots) if roots else (package_root(),)
        self.counts: dict[Finding, int] = {}

    @property
    def findings(self) -> list[Finding]:
        return sorted(self.counts, key=lambda f: (f.file, f.line, f.factory))

    def report(self) -> str:
        return "\n".join(f"{f}  (x{self.counts[f]})" for f in self.findings) or "no device-less factory calls"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None and not self._exempt(func, args):
            self._record(func)
        return func(*args, **kwargs)

    @staticmethod
    def _exempt(func, args) -> bool:
        if func in _WRAPPERS and args and isinstance(args[0], torch.Tensor):
            return True                       # a tensor stays on its device
        return torch.get_default_device().type != "cpu"   # inside an explicit `with torch.device(...)`

    def _record(self, func) -> None:
        frame = sys._getframe(2)
        while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR)
                                     or os.path.abspath(frame.f_code.co_filename) == _THIS):
            frame = frame.f_back
        if frame is None:
            return
        path = os.path.abspath(frame.f_code.co_filename)
        root = next((r for r in self.roots if path.startswith(r)), None)
        if root is None:
            return
        f = Finding(getattr(func, "__name__", str(func)), Path(path[len(root):]).as_posix(), frame.f_lineno,
                    frame.f_code.co_name)
        self.counts[f] = self.counts.get(f, 0) + 1
