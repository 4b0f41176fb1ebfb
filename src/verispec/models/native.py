"""Builds verispec's C++ ops (``csrc/``) on first use with ``torch.utils.cpp_extension``.

Contract
- ``build(name, source)`` compiles ``csrc/<source>`` into an importable module (once per machine
  and source: the build is cached in torch's extensions folder, ``TORCH_EXTENSIONS_DIR``, under
  ``verispec/<name>-<hash>``, the hash of the sources, flags, torch and Python, and of where the
  sources and the environment are, so two checkouts never rebuild each other's op) and returns
  it; it raises what the build raised. Concurrent processes build it once: they queue on an OS
  lock (``flock``), which the kernel releases when its holder dies. torch's own lock file is a
  plain file that a killed build leaves behind, after which every later load waited forever
  without a word; under the OS lock such a file can only be stale, so it is removed, with a warning.
- ``failure(exc, source)`` turns a build error into one line (the compiler's first error), for
  the callers' fallback warnings.
- FBGEMM's public headers include asmjit only for register types of its code generators, which
  these ops never use; ``csrc/asmjit`` stands in for them.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import warnings
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


def build_dir(name: str, source: str) -> Path:
    """Where ``build`` keeps the op: one folder per content of its sources (the op's file and
    every header of ``csrc/``), flags, torch and Python, and per location of ``csrc/`` and of the
    environment (``sys.prefix``). torch writes the absolute source and include paths into the
    folder's ``build.ninja`` and rebuilds when they change, so two checkouts of the same sources
    sharing a folder rebuilt each other's ops at every switch (about 80 s for the int4, fp16 and
    attention ops on 2 cores: a CI clone, then the working checkout)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root
    h = hashlib.sha256(f"{FLAGS}|{torch.__version__}|{sys.version}|{CSRC.resolve()}|{sys.prefix}".encode())
    for f in [CSRC / source, *sorted(CSRC.rglob("*.h"))]:
        h.update(str(f.relative_to(CSRC)).encode() + b"\0" + f.read_bytes())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / "verispec" / f"{name}-{h.hexdigest()[:16]}"


@contextlib.contextmanager
def _os_lock(folder: Path):
    """Hold an exclusive ``flock`` on ``folder/verispec.lock`` (released by the kernel if the
    holder dies); remove torch's lock file there, which only a killed build can have left."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:                                  # no flock: torch's lock alone
        yield
        return
    with open(folder / "verispec.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = folder / "lock"
            if stale.exists():
                warnings.warn(f"verispec: removing {stale}, left by a build that was killed", RuntimeWarning,
                              stacklevel=4)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(name: str, source: str):
    from torch.utils.cpp_extension import load
    _ninja_on_path()
    folder = build_dir(name, source)
    with _os_lock(folder):
        return load(name=name, sources=[str(CSRC / source)], extra_include_paths=[str(CSRC)],
                    extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)


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
