"""torchao.float8's public module paths and names, as `tests/fixtures/
torchao_float8_names.json` records them for torchao 0.18 (and the extras lane derives them
from the installed torchao with `derive_names`).

A public name of a submodule: a module attribute not starting with `_` that is torchao's own
object (its `__module__` under `torchao.float8`: the module's classes and functions, and
those it imports from its sibling modules, which users import from there too) or a plain
constant (a number, a set, a dtype). The package itself: its `__all__` plus such names.
Names of `typing` (`TYPE_CHECKING`) and private modules (`_inductor_patch`) are not
public.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import typing
from pathlib import Path

import torch

NAMES_FILE = Path(__file__).resolve().parents[1] / "fixtures" / "torchao_float8_names.json"


def committed_names() -> dict[str, list[str]]:
    return json.loads(NAMES_FILE.read_text())["modules"]


def _public(module) -> set[str]:
    names = set(getattr(module, "__all__", ()))
    for name, value in vars(module).items():
        if name.startswith("_") or inspect.ismodule(value) or hasattr(typing, name):
            continue  # private, a module, or typing's (TYPE_CHECKING)
        constant = isinstance(value, (bool, int, float, set, frozenset, torch.dtype))
        if constant or str(getattr(value, "__module__", "")).startswith("torchao.float8"):
            names.add(name)
    return names


def derive_names() -> dict[str, list[str]]:
    """{submodule ("" for the package): sorted public names} of the installed torchao."""
    package = importlib.import_module("torchao.float8")
    out = {"": sorted(_public(package))}
    for info in pkgutil.iter_modules(package.__path__):
        if not info.name.startswith("_"):
            module = importlib.import_module(f"torchao.float8.{info.name}")
            out[info.name] = sorted(_public(module))
    return dict(sorted(out.items()))


if __name__ == "__main__":  # rewrite the committed list from the installed torchao
    import torchao

    text = {"torchao_version": torchao.__version__, "modules": derive_names()}
    NAMES_FILE.write_text(json.dumps(text, indent=1) + "\n")
