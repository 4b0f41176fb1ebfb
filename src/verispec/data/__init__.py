"""Data files shipped with verispec (Spec-Bench questions, see ATTRIBUTION.md)."""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path


def spec_bench_path() -> Path:
    return Path(str(resources.files(__package__) / "spec_bench_questions.jsonl"))


def spec_bench_questions(path: str | Path | None = None) -> list[dict]:
    """Spec-Bench-format questions (``question_id``, ``category``, ``turns``), in file order."""
    p = Path(path) if path else spec_bench_path()
    out = []
    for n, line in enumerate(p.read_text().split("\n"), 1):
        if not line.strip():
            continue
        q = json.loads(line)
        if not isinstance(q.get("turns"), list) or not q["turns"] or "category" not in q:
            raise ValueError(f"{p}:{n}: a question needs 'category' and a non-empty 'turns' list")
        out.append(q)
    return out


def per_category(questions: list[dict], n: int) -> list[dict]:
    """The first ``n`` questions of each category, categories in order of first appearance."""
    seen: dict[str, int] = {}
    out = []
    for q in questions:
        if seen.get(q["category"], 0) < n:
            seen[q["category"]] = seen.get(q["category"], 0) + 1
            out.append(q)
    return out
