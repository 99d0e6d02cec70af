"""The trainer package's shape: the library's tests (tests/unit, tests/distributed, the
shared tests/models.py) do not import it, and its modules import each other without a
circle."""

from __future__ import annotations

from pathlib import Path

from tests.import_graph import circles, imported_names

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "f8train"


def _imports(path: Path) -> set[str]:
    """Absolute module names imported anywhere in ``path`` (functions included)."""
    return imported_names(path)


def test_library_tests_do_not_import_the_trainer():
    files = [*(REPO / "tests/unit").rglob("*.py"), *(REPO / "tests/distributed").rglob("*.py")]
    files.append(REPO / "tests/models.py")
    offenders = {
        str(f.relative_to(REPO)): sorted(n for n in _imports(f) if n.split(".")[0] == PACKAGE)
        for f in files
    }
    assert {f: n for f, n in offenders.items() if n} == {}


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
    assert circles(graph) == []
