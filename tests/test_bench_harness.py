"""The benchmark harness (``verispec.bench.harness``): its writer and ``--rerender`` round trip
and its machine record on a fake result (no model, no measurement), its timing loops, and a
static check that every script in benchmarks/ writes through it."""
from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

import pytest

from verispec.bench import harness

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

# Scripts allowed to call write_text / json.dump themselves, with the reason. Each one's calls
# must not touch its result files (those go through the harness).
WRITES_ALLOWED = {
    "forward_shapes.py": "copies git's baseline modules into a temporary package to import them",
}


def _render(res: dict) -> str:
    return "| method | ms |\n|---|---|\n" + "\n".join(f"| {k} | {v:.2f} |" for k, v in res["ms"].items())


def test_record_has_the_machine_and_the_command():
    rec = harness.machine_record([str(ROOT / "benchmarks" / "fake.py"), "--reps", "3"])
    for key in ("cpu", "isa", "cores", "torch", "threads", "python", "load_avg", "date", "command"):
        assert key in rec, key
    assert rec["cpu"] and rec["cores"] >= 1 and rec["date"].endswith("UTC")
    assert rec["command"] == "python benchmarks/fake.py --reps 3"
    json.dumps(rec)                                            # plain JSON values only
    line = harness.machine_line(rec)
    assert line.startswith(rec["cpu"]) and f"{rec['cores']} cores" in line


def test_isa_from_cpu_flags():
    assert harness.vector_isa("flags : fpu avx2 avx512f avx512_bf16") == "AVX-512 with bf16/VNNI"
    assert harness.vector_isa("flags : fpu avx2 avx512f") == "AVX-512"
    assert harness.vector_isa("flags : fpu sse avx2") == "AVX2"
    assert harness.vector_isa("") == "unknown"


def test_machine_line_reads_older_records():
    old = {"cpu": "AMD EPYC", "cores": 2, "torch": "2.13.0+cpu", "threads": 1, "load_avg_at_start": 2.5}
    assert harness.machine_line(old) == "AMD EPYC, 2 cores, torch 2.13.0+cpu, 1 thread, load 2.5 at the start"
    assert harness.machine_line("x86_64, 2 cores") == "x86_64, 2 cores"
    bench = {"cpu_model": "Xeon", "logical_cores": 4, "loadavg_start": [1.0, 2.0, 3.0]}
    assert harness.machine_line(bench) == "Xeon, 4 cores, load 1.0 at the start"


def test_write_then_rerender_round_trip(tmp_path):
    out = harness.Output("fake", "A fake result", _render)
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    args = out.parse(ap, ["--out", str(tmp_path / "sub" / "fake")])
    assert args.reps == 3 and not args.rerender
    res = {"machine": harness.machine_record([str(ROOT / "benchmarks" / "fake.py")]), "ms": {"a": 1.234, "b": 5.0}}
    md = out.write(res, args.out)
    first = md.read_text()
    assert json.loads((tmp_path / "sub" / "fake.json").read_text()) == res
    assert first.startswith("# A fake result\n\nMachine: ") and "Command: `python benchmarks/fake.py`" in first
    assert "| a | 1.23 |" in first and res["machine"]["date"] in first
    assert not list((tmp_path / "sub").glob(".*tmp"))         # the atomic writes left no temporary file
    md.write_text("stale")
    assert out.parse(argparse.ArgumentParser(), ["--out", args.out, "--rerender"]) is None
    assert md.read_text() == first                             # rebuilt from the JSON alone


def test_analysis_and_legacy_header(tmp_path):
    out = harness.Output("fake", lambda r: f"Fake: {r['model']}", _render, analysis=True,
                         legacy_command=lambda r: f"python benchmarks/fake.py --model {r['model']}")
    base = tmp_path / "fake"
    (tmp_path / "fake.json").write_text(json.dumps({"machine": "old machine", "measured_at": "2026-01-01 00:00 UTC",
                                                     "model": "m", "ms": {"a": 1.0}}))
    (tmp_path / "fake.analysis.md").write_text("Hand-written reading.\n")
    text = out.rerender(base).read_text()
    assert text.startswith("# Fake: m\n\nMachine: old machine. Measured 2026-01-01 00:00 UTC. "
                           "Command: `python benchmarks/fake.py --model m`.\n")
    assert text.endswith("## Analysis\n\nHand-written reading.\n")


def test_model_option_names_the_default_result(tmp_path):
    out = harness.Output("speed", "t", _render, model="smollm2-135m")
    args = out.parse(argparse.ArgumentParser(), ["--model", "qwen2.5-coder-1.5b"])
    assert args.out == str(harness.RESULTS / "speed_qwen2.5-coder-1.5b")
    args = out.parse(argparse.ArgumentParser(), ["--out", str(tmp_path)])     # a folder: <folder>/<name>
    assert args.out == str(tmp_path / "speed") and args.model == "smollm2-135m"
    assert harness.settings(args) == {"model": "smollm2-135m"}


def test_interleave_runs_every_method_once_per_round():
    calls = []
    fns = {n: (lambda n=n: calls.append(n) or len(calls)) for n in "abc"}
    got = harness.interleave(fns, 3, rotate=True, timed=False)
    assert calls == list("abc" "bca" "cab")
    assert got == {"a": [1, 6, 8], "b": [2, 4, 9], "c": [3, 5, 7]}
    calls.clear()
    times = harness.interleave(fns, 2, alternate=True)
    assert calls == list("cba" "abc") and all(len(v) == 2 and min(v) >= 0 for v in times.values())
    assert harness.medians({"x": [3.0, 1.0, 2.0]}, 1e3) == {"x": 2000.0}


def test_generate_interleaved_runs_each_prompt_through_every_method():
    """Prompt by prompt, every method in turn, each output compared with the first method's."""
    from types import SimpleNamespace
    calls = []

    def fake(name, flip):
        def generate(reqs, params):
            ids = reqs[0]["prompt_token_ids"]
            calls.append((name, tuple(ids), params))
            return [SimpleNamespace(token_ids=[ids[0] + (flip and ids[0] == 2)])]
        return SimpleNamespace(generate=generate)
    llms = {"vanilla": fake("vanilla", False), "spec": fake("spec", True)}
    got = list(harness.generate_interleaved(llms, [("a", [1, 9]), ("b", [2])], "params"))
    assert [c[:2] for c in calls] == [("vanilla", (1, 9)), ("spec", (1, 9)), ("vanilla", (2,)), ("spec", (2,))]
    assert all(c[2] == "params" for c in calls)
    assert [(g.index, g.category, g.method, g.same_as_first) for g in got] == [
        (0, "a", "vanilla", True), (0, "a", "spec", True), (1, "b", "vanilla", True), (1, "b", "spec", False)]
    assert all(g.seconds >= 0 for g in got) and got[3].prompt_ids == [2]


def test_run_trees_rounds_over_source_trees(tmp_path):
    script = tmp_path / "w.py"
    script.write_text("import json, os, sys\nprint('noise')\n"
                      "print(json.dumps({'src': os.environ['PYTHONPATH'], 'args': sys.argv[1:]}))\n")
    runs = harness.run_trees(str(script), [str(tmp_path), str(ROOT / "src")], ["t", "main"], 2, ["--x", "1"])
    assert list(runs) == ["t", "main"] and len(runs["t"]) == 2
    assert runs["t"][0] == {"src": str(tmp_path.resolve()), "args": ["--worker", "--x", "1"]}
    with pytest.raises(SystemExit):
        harness.run_trees(str(script), [str(tmp_path)], [], 1, [])


def _calls(tree: ast.AST) -> set[str]:
    """Names of the write calls in a script: ``write_text``, ``json.dump`` (``json.dumps`` is
    fine: it writes nothing)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr == "write_text":
                found.add("write_text")
            elif f.attr == "dump" and isinstance(f.value, ast.Name) and f.value.id == "json":
                found.add("json.dump")
    return found


def _imports_harness(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "verispec.bench" and \
                any(a.name == "harness" for a in node.names):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and "verispec.bench.harness" in (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]):
            return True
    return False


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_every_script_writes_through_the_harness(script):
    tree = ast.parse((BENCHMARKS / script).read_text(), script)
    assert _imports_harness(tree), f"benchmarks/{script} does not import verispec.bench.harness"
    writes = _calls(tree)
    if script in WRITES_ALLOWED:
        assert writes, f"{script} no longer writes files itself: drop it from WRITES_ALLOWED"
    else:
        assert not writes, f"benchmarks/{script} calls {sorted(writes)} itself: write results through the harness"


def test_no_script_keeps_the_old_helpers():
    assert not (BENCHMARKS / "machine.py").exists() and not (BENCHMARKS / "interleave.py").exists()
