"""Builds verispec's C++ ops (``csrc/``) on first use with ``torch.utils.cpp_extension``.

Contract
- ``build(name, source)`` compiles ``csrc/<source>`` into an importable module (once per machine:
  the build is cached in torch's extensions folder, ``TORCH_EXTENSIONS_DIR``, under a file lock,
  so concurrent processes build it once) and returns it; it raises what the build raised.
- ``failure(exc, source)`` turns a build error into one line (the compiler's first error), for
  the callers' fallback warnings.
- FBGEMM's public headers include asmjit only for register types of its code generators, which
  these ops never use; ``csrc/asmjit`` stands in for them.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"

# at::parallel_for is an OpenMP region compiled into each op; no float contraction, so a kernel's
# scalar epilogue gives the same bits wherever the compiler inlines it
FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]


def _ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; an un-activated venv has it only in its bin."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")


def build(name: str, source: str):
    from torch.utils.cpp_extension import load
    _ninja_on_path()
    return load(name=name, sources=[str(CSRC / source)], extra_include_paths=[str(CSRC)],
                extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], verbose=False)


def failure(exc: Exception, source: str) -> str:
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    why = next((ln for ln in lines if "error" in ln.lower()), lines[-1])
    return f"building csrc/{source} failed: {why.strip()[:300]}"


class NativeOp:
    """One C++ op module of ``csrc/``, loaded once per process with the same rules for every op.

    ``module()`` is the built module, or ``None`` where it cannot be had; ``reason()`` then says
    why (``None`` while it is available). In order: ``off()`` (a reason to stay off, e.g. an
    environment switch; checked at the first load), a CPU without AVX2, ``precondition()``
    (another reason, e.g. a torch build without the library the op wraps), the build itself (a
    failure warns once, naming ``fallback``: what runs instead), and, for ops that report their
    instruction set (``isa()``), ``"none"`` (``no_isa``: the instructions the op needs). Once
    built, ``fake()`` registers the op's output shape for torch.compile's tracing."""

    def __init__(self, name: str, source: str, *, fallback: str, no_isa: str = "",
                 off=None, precondition=None, fake=None):
        self.name, self.source, self.fallback, self.no_isa = name, source, fallback, no_isa
        self._off, self._pre, self._fake = off, precondition, fake
        self._loaded = False
        self._module = None
        self._reason: str | None = None

    def module(self):
        if not self._loaded:
            self._loaded = True
            self._module, self._reason = self._load()
        return self._module

    def reason(self) -> str | None:
        self.module()
        return self._reason

    def _load(self):
        import warnings

        import torch
        why = self._off() if self._off else None
        if why is None and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
            why = "this CPU has no AVX2"
        if why is None and self._pre:
            why = self._pre()
        if why is not None:
            return None, why
        try:
            ext = build(self.name, self.source)
        except Exception as e:                           # no compiler, headers, ninja
            why = failure(e, self.source)
            warnings.warn(f"verispec: {why}; {self.fallback}", RuntimeWarning, stacklevel=4)
            return None, why
        if hasattr(ext, "isa") and ext.isa() == "none":
            return None, f"this CPU has {self.no_isa or 'not the instructions the op needs'}"
        if self._fake:
            self._fake()
        return ext, None
