"""Import graphs for the layout tests: which modules a file imports (parsed with `ast`, imports
inside functions and `TYPE_CHECKING` blocks included) and the circles of a graph."""

from __future__ import annotations

import ast
import functools
from pathlib import Path


def imported_names(path: Path, module: str = "") -> set[str]:
    """Dotted names imported anywhere in `path`: each `import a.b`, each `from a import b`
    as both `a` and `a.b`; relative imports resolved against `module` (the file's own
    dotted name, a package's being its folder's)."""
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package that holds `module`
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan), or of one node
    that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@functools.cache
def module_graph(package: Path) -> dict[str, set[str]]:
    """Dotted module name -> the package's modules it imports, for every module under
    `package` (a folder holding `__init__.py`)."""
    files = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    known = set(files)
    return {
        module: (imported_names(path, module) & known) - {module} for module, path in files.items()
    }
