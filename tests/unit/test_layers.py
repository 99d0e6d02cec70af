"""The subpackages are layers (DESIGN.md, "One home per concept"); each imports only the
layers below it, so no two subpackages import each other, directly or around a circle:

    core -> formats -> weight_wrappers -> nn, experts -> tensor_parallel, fsdp
         -> tools, integrations (and the package's face: fsdp_float8/__init__.py, the
            torchao-compatible `float8/` paths)

Two subpackages of one layer may import each other one way (`nn/convert.py` swaps in
`experts/` modules), never both ways. Every module sits in its folder's layer: the folder
graph (subpackages as nodes, imports as edges) has no circle. The graph is parsed with
`ast` (`tests/import_graph.py`): imports inside functions and `TYPE_CHECKING` blocks
count, as a lazy import hides a dependency without removing it.
"""

from __future__ import annotations

from pathlib import Path

from tests.import_graph import circles, module_graph

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_float8"
TOP = "(face)"  # fsdp_float8/__init__.py and the modules directly under fsdp_float8/
LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(names)
    for names in (
        {"core"},
        {"formats"},
        {"weight_wrappers"},
        {"nn", "experts"},
        {"tensor_parallel", "fsdp"},
        {"tools", "integrations", "float8", TOP},
    )
)


def subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else TOP


def layer(module: str) -> int:
    name = subpackage(module)
    return next(i for i, names in enumerate(LAYERS) if name in names)


def subpackage_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Folder graph: each subpackage (a folder under fsdp_float8/, the face as one node) ->
    the other subpackages its modules import. Every module counts as its folder."""
    edges: dict[str, set[str]] = {}
    for module, targets in graph.items():
        edges.setdefault(subpackage(module), set()).update(subpackage(t) for t in targets)
    return {n: targets - {n} for n, targets in edges.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for each import of a module in a higher layer."""
    return sorted(
        f"{m} -> {t}" for m, targets in graph.items() for t in targets if layer(t) > layer(m)
    )


def test_every_subpackage_has_a_layer():
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    placed = set().union(*LAYERS)
    assert folders - placed == set(), sorted(folders - placed)


def test_no_circle_between_subpackages():
    found = circles(subpackage_graph(module_graph(PACKAGE)))
    assert found == [], found


def test_each_module_imports_only_its_layer_and_those_below():
    assert upward_imports(module_graph(PACKAGE)) == []


def test_the_checks_find_a_circle_and_an_upward_import():
    # experts -> fsdp -> nn -> experts: the circle the float8 step's isinstance checks made
    graph = {
        "fsdp_float8.experts.modules": {"fsdp_float8.fsdp.refresh"},
        "fsdp_float8.fsdp.refresh": {"fsdp_float8.nn.linear"},
        "fsdp_float8.nn.linear": {"fsdp_float8.experts.modules"},
    }
    assert circles(subpackage_graph(graph)) == [{"experts", "fsdp", "nn"}]
    assert upward_imports(graph) == ["fsdp_float8.experts.modules -> fsdp_float8.fsdp.refresh"]
    # a module imported by a lower layer is a circle of folders, whatever it imports itself:
    # nn/ builds the delayed state the float8 step (fsdp/) syncs, fsdp/ imports nn/
    graph = {
        "fsdp_float8.nn.linear": {"fsdp_float8.fsdp.delayed_state"},
        "fsdp_float8.fsdp.delayed_state": {"fsdp_float8.core.scaling"},
        "fsdp_float8.fsdp.step": {"fsdp_float8.nn.convert"},
    }
    assert circles(subpackage_graph(graph)) == [{"fsdp", "nn"}]
    assert upward_imports(graph) == ["fsdp_float8.nn.linear -> fsdp_float8.fsdp.delayed_state"]
