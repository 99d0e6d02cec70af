"""The float8 step's view of a model, built by walking the module tree once and cached.

A `Structure` is what the step needs of a model: its units (`refresh.Unit`, in module order),
the model's default reduction group (its FSDP2 mesh), and the ids of its parameters (which
optimizers hold the model). Building it walks the module tree; a steady training step must
not, so each step keeps its structure and checks two cheap facts before using it:

- nothing registered a module or a parameter anywhere since (torch's global registration
  hooks bump `generation`: a module swap, `convert_to_float8_training`, a replaced
  parameter through `setattr`);
- each unit's parameter is the object it was (FSDP2's `fully_shard` swaps parameters
  without a registration hook, and swaps them again around each unshard; a unit holds its
  module and the attribute name, so a swap only costs a rebuild, never a stale unit).

Which optimizers hold which steps is cached per optimizer the same way (`held_by`).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from fsdp_float8.core.amax_sync import Group
from fsdp_float8.fsdp.refresh import Unit, mesh_of, units_of

_generation = [0]
_builds = [0]


def _registered(*_args) -> None:
    _generation[0] += 1


register_module_module_registration_hook(_registered)
register_module_parameter_registration_hook(_registered)


def generation() -> int:
    """How many modules and parameters were registered in this process so far."""
    return _generation[0]


def builds() -> int:
    """How many structures were built in this process so far."""
    return _builds[0]


def _unit_params(units: list[Unit]) -> list[tuple[int, int]]:
    """The id of each unit's parameter and of its local tensor (a DTensor's `_local_tensor`,
    which `Unit.weight` resolves: replacing it, as `wrap_weight_for_fsdp` does, rebuilds)."""
    ids = []
    for u in units:  # a loop, not a comprehension: no call per check (`current`)
        p = getattr(u.module, u.name)
        ids.append((id(p), id(getattr(p, "_local_tensor", None))))
    return ids


@dataclass(frozen=True, eq=False)
class Structure:
    units: list[Unit]
    default: Group  # the model's FSDP2 mesh (None: no FSDP2)
    param_ids: frozenset[int]
    built_at: int  # `generation()` when built
    unit_params: list[tuple[int, int]]  # ids of each unit's parameter when built
    serial: int  # builds in this process before this one
    # what the float8 step derives from the structure and keeps while it holds (`step.py`)
    memo: dict = field(default_factory=dict)

    @classmethod
    def build(cls, model: nn.Module) -> Structure:
        units = units_of(model)  # the one walk of the module tree
        params = list(model.parameters())  # and the one of its parameters
        _builds[0] += 1
        return cls(
            units=units,
            default=mesh_of(params),
            param_ids=frozenset(map(id, params)),
            built_at=generation(),
            unit_params=_unit_params(units),
            serial=_builds[0],
        )

    def current(self) -> bool:
        """Nothing registered since the build, and every unit holds the same parameter."""
        return self.built_at == _generation[0] and self.unit_params == _unit_params(self.units)

    @cached_property
    def delayed(self) -> list:
        """The delayed-scaling states of the units, in order (`Unit.state`)."""
        return [s for u in self.units if (s := u.state) is not None]

    @cached_property
    def dynamic(self) -> list:
        """The dynamic tensorwise float8-gathered weights of the units (`Unit.weight`)."""
        return [w for u in self.units if (w := u.weight) is not None]


# optimizer -> (its parameter count, generation, each step and its structure's serial),
# the steps it holds
_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def held_by(optimizer: torch.optim.Optimizer, steps: Mapping) -> list:
    """The steps (`{model: step}`) whose model has a parameter the optimizer holds.
    `step.structure()` gives each step's current `Structure`. The answer is kept per
    optimizer while its parameter count, the registrations, the steps and the structures
    they last built stand: a hit checks no model's structure (a held step checks its own
    where it refreshes; a rebuild there is a new serial, so the next call asks again), and
    costs the same however many models the process holds."""
    live = list(steps.values())
    n = sum([len(g["params"]) for g in optimizer.param_groups])
    cached = _HELD.get(optimizer)
    if cached is not None:
        built = [(id(s), -1 if (st := s._structure) is None else st.serial) for s in live]
        key = (n, _generation[0], built)
        if cached[0] == key:
            return [s for ref in cached[1] if (s := ref()) is not None]
    structures = [(s, s.structure()) for s in live]
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    held = [s for s, st in structures if not ids.isdisjoint(st.param_ids)]
    key = (n, _generation[0], [(id(s), st.serial) for s, st in structures])
    _HELD[optimizer] = (key, [weakref.ref(s) for s in held])
    return held
