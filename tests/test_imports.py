"""The package's imports flow one way: no import cycle, counting the imports inside
functions (a function-level import hides a cycle, it does not remove it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "maxkv"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


class _Imports(ast.NodeVisitor):
    """A module's imports of maxkv modules, wherever they are, except under
    ``if TYPE_CHECKING:`` (annotations only, never run)."""

    def __init__(self, module: str, package: bool, known: dict[str, Path]) -> None:
        self.base = module.split(".") if package else module.split(".")[:-1]
        self.known = known
        self.found: dict[str, int] = {}

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def _add(self, target: str, line: int) -> None:
        if target in self.known:
            self.found.setdefault(target, line)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.base[: len(self.base) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        for alias in node.names:
            child = f"{target}.{alias.name}"
            self._add(child if child in self.known else target, node.lineno)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)


def import_graph() -> dict[str, dict[str, int]]:
    """maxkv module -> the maxkv modules it imports (-> the line), leaving out a
    module's own parent packages (importing a package's name from inside it)."""
    known = _modules()
    graph = {}
    for module, path in known.items():
        visitor = _Imports(module, path.name == "__init__.py", known)
        visitor.visit(ast.parse(path.read_text()))
        graph[module] = {
            target: line
            for target, line in visitor.found.items()
            if target != module and not module.startswith(target + ".")
        }
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            component.append(v)
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_cycle_through_a_function_level_import() -> None:
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert cycles(graph) == [["a", "b", "c"]]
    source = "def f():\n    from .b import x\nif TYPE_CHECKING:\n    from .c import y\n"
    visitor = _Imports("maxkv.a", False, {"maxkv.b": PACKAGE, "maxkv.c": PACKAGE})
    visitor.visit(ast.parse(source))
    assert visitor.found == {"maxkv.b": 2}


def test_maxkv_has_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 50 and "maxkv.models.registry" in graph["maxkv.models.config"]
    found = cycles(graph)
    detail = [
        f"{a} -> {b} (line {graph[a][b]})" for c in found for a in c for b in graph[a] if b in c
    ]
    assert not found, detail
