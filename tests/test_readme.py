"""The README's headline table comes from one committed benchmark run: every number in it is
checked against ``benchmarks/results/spec_core.json``."""
from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _headline_rows() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Headline numbers"):]
    section = section[:section.index("\n## ", 3)]
    return [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| target")]


def test_headline_numbers_are_those_of_the_committed_run():
    run = json.loads((ROOT / "benchmarks/results/spec_core.json").read_text())
    have = set()
    for part in run["parts"]:
        if part["weights"] != "fp16":
            continue
        base = part["overall"]["vanilla"]["tokens_per_s"]
        for name, o in part["overall"].items():
            if name != "vanilla":
                have.add((f"{o['tokens_per_s']:.2f}", f"{base:.2f}", f"{o['speedup']:.2f}x", f"{o['tau']:.2f}",
                          "yes" if o["identical_to_vanilla"] else "NO"))
    rows = _headline_rows()
    assert len(rows) >= 4
    for row in rows:
        assert tuple(row[2:7]) in have, row
        assert re.fullmatch(r"\d+\.\d\dx", row[4])
    assert "cores" in (ROOT / "README.md").read_text().split("## Headline numbers")[1][:600]


def test_layout_table_names_every_module():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout"):]
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
