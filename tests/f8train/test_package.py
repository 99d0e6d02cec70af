"""The trainer package's shape: the library's tests (tests/unit, tests/distributed, the
shared tests/models.py) do not import it, and its modules import each other without a
circle."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "f8train"


def _imports(path: Path) -> set[str]:
    """Absolute module names imported anywhere in ``path`` (functions included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_library_tests_do_not_import_the_trainer():
    files = [*(REPO / "tests/unit").rglob("*.py"), *(REPO / "tests/distributed").rglob("*.py")]
    files.append(REPO / "tests/models.py")
    offenders = {
        str(f.relative_to(REPO)): sorted(n for n in _imports(f) if n.split(".")[0] == PACKAGE)
        for f in files
    }
    assert {f: n for f, n in offenders.items() if n} == {}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_trainer_modules_import_without_a_circle():
    modules = {p.stem: p for p in (REPO / PACKAGE).glob("*.py") if p.stem != "__init__"}
    graph = {
        name: {
            n.split(".")[1]
            for n in _imports(path)
            if n.startswith(f"{PACKAGE}.") and n.split(".")[1] in modules
        }
        for name, path in modules.items()
    }
    assert _cycles(graph) == []
