"""The trainer package's shape: the library's tests (tests/unit, tests/distributed, the
shared tests/models.py) do not import it, and its modules import each other without a
circle."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "scripts"


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
