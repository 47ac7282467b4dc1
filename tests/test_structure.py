"""The layering stays as designed: no import circles among spotlight/, tasks/ and flows/, and the library
never imports the orchestration (Prefect, SkyPilot). Every import counts: module-level, inside a
function, or under ``TYPE_CHECKING``; a lazy import only hides a circle, it does not remove it."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("spotlight", "tasks", "flows")


def _modules() -> dict[str, Path]:
    """Module name -> file, for every first-party module (a package is named by its ``__init__``)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imported_names(module: str, path: Path) -> list[str]:
    """Every dotted name an ``import`` or ``from ... import`` in the file may refer to (relative ones resolved)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return names


def import_graph() -> dict[str, set[str]]:
    """First-party module -> the first-party modules it imports (the nearest enclosing module of a name)."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for name in _imported_names(module, path):
            target = resolve(name)
            # a submodule naming its own package (``from spotlight.config import base`` inside it) is no edge
            if target and target != module and not module.startswith(f"{target}."):
                graph[module].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_the_library_never_imports_the_orchestration():
    graph_names = {m: _imported_names(m, p) for m, p in _modules().items() if m.startswith("spotlight")}
    bad = {m: sorted({n for n in names if n.split(".")[0] in ("prefect", "sky")})
           for m, names in graph_names.items()}
    assert {m: n for m, n in bad.items() if n} == {}
