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
