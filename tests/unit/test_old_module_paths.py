"""The module paths of earlier releases still import, with a DeprecationWarning.

`fsdp_float8.delayed_state` and `fsdp_float8.comm_stats` moved into subpackages
(`fsdp_float8.fsdp.delayed_state`, `fsdp_float8.tools.comm_stats`); the old paths are thin
aliases for one release: importing one warns, names the new path, and gives the very
objects of the new home (so isinstance checks and patches keep working).
"""

from __future__ import annotations

import importlib
import sys

import pytest

OLD_PATHS = {
    "fsdp_float8.delayed_state": (
        "fsdp_float8.fsdp.delayed_state",
        ["DelayedScalingState", "DelayedState", "export_state_dict"],
    ),
    "fsdp_float8.comm_stats": (
        "fsdp_float8.tools.comm_stats",
        ["CollectiveCounter", "CollectiveKind", "CollectiveRecord"],
    ),
}


def _fresh_import(name: str):
    sys.modules.pop(name, None)
    __import__(name)  # an import statement's path (importlib.import_module is a frame more)
    return sys.modules[name]


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_old_path_warns_and_gives_the_same_objects(old: str) -> None:
    new, names = OLD_PATHS[old]
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated.*{new}") as caught:
        alias = _fresh_import(old)
    # the warning points at the importing line, not at the import machinery
    assert caught[0].filename == __file__
    target = importlib.import_module(new)
    for name in names:
        assert getattr(alias, name) is getattr(target, name), name
    assert sorted(alias.__all__) == sorted(names)


def test_from_import_of_an_old_path() -> None:
    sys.modules.pop("fsdp_float8.delayed_state", None)
    with pytest.warns(DeprecationWarning):
        from fsdp_float8.delayed_state import export_state_dict
    import fsdp_float8

    assert export_state_dict is fsdp_float8.export_state_dict
