"""The README stays honest: its results table is the one rendered from the committed result files
(``python -m verispec.bench.suites table --write``), its Python examples compile, every relative
link in it and in docs/ points at a file that exists, and ``docs/layout.md`` names every module."""
from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def load_suites():
    """``verispec.bench.suites`` loaded from its file alone (standard library; no torch import)."""
    name = "_verispec_bench_suites"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "src/verispec/bench/suites.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_results_table_is_rendered_from_the_committed_results():
    suites = load_suites()
    assert suites.readme_block(README.read_text()) == suites.render_table().strip(), \
        "README's results table is stale: run `python -m verispec.bench.suites table --write`"
    assert "cores" in suites.render_table()


def test_readme_python_examples_compile():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 3
    for code in blocks:
        ast.parse(code)


def test_relative_links_exist():
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), (doc.name, target)


def test_layout_table_names_every_module():
    text = (ROOT / "docs" / "layout.md").read_text()
    section = text[text.index("# Layout"):]
    section = section[:section.index("\n## ", 3)]
    listed = set(re.findall(r"\| `([^`]+)` \|", section))
    src = ROOT / "src" / "verispec"
    missing = []
    for p in sorted(src.iterdir()):
        if p.name.startswith("__") or p.suffix not in (".py", "") or p.name.endswith(".egg-info"):
            continue
        rel = f"src/verispec/{p.name}" + ("/" if p.is_dir() else "")
        if rel not in listed:
            missing.append(rel)
    assert not missing, missing
