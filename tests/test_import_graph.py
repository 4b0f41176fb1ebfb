"""No import cycles inside the package: every module under src/verispec is parsed with ``ast``; each
``import`` / ``from ... import`` (module level and inside functions alike, relative and absolute)
that names a verispec module is an edge; the graph must have no cycle.

An edge goes to the module imported: ``from .a import b`` -> ``a.b`` when ``a/b.py`` exists (a
submodule), else -> ``a``. A package's ``__init__`` importing its own submodules is an ordinary
edge; the implicit import of parent packages is not (every submodule import would close a loop).
"""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "verispec"

# Cycles still allowed (each as a tuple of its modules, sorted): none. Add one only with the reason
# and the issue that removes it.
ALLOWED_CYCLES: set[tuple[str, ...]] = set()


def modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package ``__init__``)."""
    out = {}
    for path in (SRC / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _base(module: str, is_pkg: bool, node: ast.ImportFrom) -> str | None:
    if not node.level:
        return node.module
    parts = module.split(".") if is_pkg else module.split(".")[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, (path, is_pkg) in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                base = _base(name, is_pkg, node)
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    if target in mods:
                        graph[name].add(target)
                    elif base in mods:
                        graph[name].add(base)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path a -> ... -> a) per strongly connected component of more than one
    module, plus self-imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[set[str]] = []

    def visit(v: str) -> None:          # Tarjan; the package is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, comp) for comp in comps]


def _cycle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    start = min(comp)
    paths, seen = [[start]], set()
    while paths:
        path = paths.pop(0)
        for w in sorted(graph[path[-1]] & comp):
            if w == start:
                return path + [start]
            if w not in seen:
                seen.add(w)
                paths.append(path + [w])
    raise AssertionError("a strongly connected component without a cycle")


def test_graph_sees_the_package():
    graph = import_graph()
    assert len(graph) > 50
    assert "verispec.formats.eagle3" in graph["verispec.train.export"]       # absolute-relative resolution
    assert "verispec.formats" in graph["verispec.drafting.medusa"]           # function-level import
    assert "verispec.llm" in graph["verispec"]                               # package __init__


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(map(tuple, find_cycles(graph))) == [("a", "b", "c", "a"), ("e", "e")]


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    unexpected = [c for c in cycles if tuple(sorted(set(c))) not in ALLOWED_CYCLES]
    assert not unexpected, "import cycles:\n" + "\n".join(" -> ".join(c) for c in unexpected)
