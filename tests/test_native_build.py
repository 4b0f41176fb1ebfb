"""The C++ ops' build folder and lock (``models.native``): one folder per source content, and a
lock file left by a killed build no longer hangs every later load."""
import multiprocessing as mp
import time

import pytest

from verispec.models import native


def _fake_csrc(tmp_path, monkeypatch, text: str):
    csrc = tmp_path / "csrc"
    csrc.mkdir(exist_ok=True)
    (csrc / "op.cpp").write_text(text)
    (csrc / "util.h").write_text("// header\n")
    monkeypatch.setattr(native, "CSRC", csrc)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    return csrc


def test_the_build_folder_follows_the_sources(tmp_path, monkeypatch):
    csrc = _fake_csrc(tmp_path, monkeypatch, "int a;\n")
    first = native.build_dir("op", "op.cpp")
    assert first == native.build_dir("op", "op.cpp")
    assert first.parent == tmp_path / "ext" / "verispec" and first.name.startswith("op-")
    (csrc / "util.h").write_text("// another header\n")          # a header is a source too
    second = native.build_dir("op", "op.cpp")
    (csrc / "op.cpp").write_text("int b;\n")
    third = native.build_dir("op", "op.cpp")
    assert len({first, second, third}) == 3


def test_two_checkouts_of_the_same_sources_build_apart(tmp_path, monkeypatch):
    """torch writes absolute paths into a folder's build.ninja and rebuilds when they change: a
    second checkout (or environment) of the same sources gets a folder of its own."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _fake_csrc(tmp_path / "a", monkeypatch, "int a;\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))       # one folder for both
    first = native.build_dir("op", "op.cpp")
    _fake_csrc(tmp_path / "b", monkeypatch, "int a;\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    second = native.build_dir("op", "op.cpp")
    monkeypatch.setattr(native.sys, "prefix", str(tmp_path / "another-venv"))
    third = native.build_dir("op", "op.cpp")
    assert first.parent == second.parent == third.parent and len({first, second, third}) == 3


def test_a_lock_file_left_by_a_killed_build_is_removed_with_a_warning(tmp_path):
    folder = tmp_path / "op-1234"
    folder.mkdir()
    (folder / "lock").write_text("")                              # torch's baton, its owner gone
    with pytest.warns(RuntimeWarning, match="killed"):
        with native._os_lock(folder):
            assert not (folder / "lock").exists()


def _hold(folder, seconds, started):
    with native._os_lock(folder):
        started.set()
        time.sleep(seconds)


def test_a_build_in_progress_is_waited_for(tmp_path):
    folder = tmp_path / "op-5678"
    ctx = mp.get_context("spawn")
    started = ctx.Event()
    holder = ctx.Process(target=_hold, args=(folder, 1.0, started))
    holder.start()
    assert started.wait(60)
    t0 = time.monotonic()
    with native._os_lock(folder):                                  # queues behind the holder
        waited = time.monotonic() - t0
    holder.join(30)
    assert waited > 0.3


def test_build_ops_reports_every_op_and_its_exit_code(capsys, monkeypatch):
    """``verispec models build-ops`` (run by ``make`` at set-up) names each op of ``csrc/`` ready or
    why not, and exits 1 when one is unavailable."""
    from verispec.cli import main
    from verispec.cli import models as cli_models
    assert set(cli_models.build_all()) == {"verispec_int4_gemm", "verispec_fp16_gemm", "verispec_attn",
                                       "verispec_int8_gemm"}
    monkeypatch.setattr(cli_models, "build_all", lambda: {"verispec_a": None, "verispec_b": None})
    assert main(["models", "build-ops"]) == 0
    assert capsys.readouterr().out.split("\n")[:2] == ["verispec_a: ready", "verispec_b: ready"]
    monkeypatch.setattr(cli_models, "build_all", lambda: {"verispec_a": None, "verispec_b": "this CPU has no AVX2"})
    assert main(["models", "build-ops"]) == 1
    assert "verispec_b: this CPU has no AVX2" in capsys.readouterr().out
