"""The benchmark results stay indexed: benchmarks/RESULTS.md links every result file (and only
files that exist), every declared suite names a result that exists (or says it has not run), the
README stays a guide (<= 250 lines) and documents every VERISPEC_* variable the package reads.
Pure file reads: nothing imports torch."""
from __future__ import annotations

import re
from pathlib import Path

from test_readme import load_suites

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "benchmarks" / "RESULTS.md"


def _links(path: Path) -> set[Path]:
    return {(path.parent / t).resolve() for t in re.findall(r"\]\(([^)#\s]+)\)", path.read_text())
            if "://" not in t}


def test_readme_is_a_guide():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines (limit 250): move detail to docs/"


def test_index_links_exist():
    missing = [str(p.relative_to(ROOT)) for p in _links(INDEX) if not p.exists()]
    assert not missing, missing


def test_every_result_file_is_indexed():
    linked = _links(INDEX)
    files = [p for p in (ROOT / "benchmarks" / "results").rglob("*") if p.is_file()]
    unlinked = [str(p.relative_to(ROOT)) for p in files if p.resolve() not in linked]
    assert not unlinked, f"not linked from benchmarks/RESULTS.md: {unlinked}"


def test_every_suite_has_its_result_and_is_indexed():
    suites = load_suites()
    text = INDEX.read_text()
    linked = _links(INDEX)
    names = [s.name for s in suites.SUITES]
    assert len(names) == len(set(names))
    for s in suites.SUITES:
        assert f"`{s.name}`" in text, f"suite {s.name} has no line in benchmarks/RESULTS.md"
        if s.result is None:
            continue                                   # declared, not yet run
        path = ROOT / s.result
        assert path.is_file(), (s.name, s.result)
        assert path.resolve() in linked, (s.name, s.result)
        if s.command[0].startswith("benchmarks/"):
            assert (ROOT / s.command[0]).is_file(), (s.name, s.command[0])


def test_every_environment_variable_is_documented():
    src = ROOT / "src" / "verispec"
    names = set()
    for p in src.rglob("*"):
        if p.suffix in (".py", ".cpp", ".h") and p.is_file():
            names |= set(re.findall(r"\bVERISPEC_[A-Z0-9_]+", p.read_text(errors="replace")))
    assert names, "no VERISPEC_* variable found: the scan is broken"
    readme = (ROOT / "README.md").read_text()
    missing = sorted(n for n in names if f"`{n}" not in readme)
    assert not missing, f"VERISPEC_* variables read in src/ but not in README.md: {missing}"
