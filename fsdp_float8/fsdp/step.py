"""The float8 step: after each optimizer step, refresh what it changed, in one collective.

Mental model. Float8 training keeps scale state outside the forward:
- the precomputed scale of each dynamic tensorwise float8-gathered weight (a linear's or an
  expert's), and the tensor amax of each 4-bit gathered weight: from the weight's amax over
  all ranks, so its FSDP2 all-gather needs no collective of its own. It is stale when the weight's values changed (the wrappers track in-place
  writes: optimizer updates, checkpoint loads, `state_dict()` tensors written in place);
- delayed scaling: the amaxes recorded since the last sync are reduced across ranks and
  rolled into the histories (`delayed_state`), once per training step.
`refresh.refresh_units` does both for a whole model in one collective per reduction group.

`float8_step(model)` gives the model's `Float8Step` (idempotent; `convert_to_float8_training`
calls it; call it yourself for float8 layers built elsewhere, e.g. from torchtitan configs).
It refreshes, always in eager code:
- after `optimizer.step()` of every torch.optim optimizer that holds a parameter of the
  model (a global step post hook, which runs after the optimizer's own hooks): the weights
  that changed and the delayed layers not synced since this step began. An optimizer that
  holds none of the model's parameters (an EMA, a frozen teacher) costs nothing, and every
  model or converted container one optimizer holds shares one collective;
- before a training forward of the model's root (a forward pre-hook that does nothing while
  torch.compile traces it, so `torch.compile(model, fullgraph=True)` works): the first one
  checks that the ranks converted alike and seeds the scales; later ones refresh only what
  an in-place write made stale since. An evaluation forward (`eval()` or no grad) never
  starts a collective.
`precompute_float8_dynamic_scale_for_fsdp` / `sync_float8_amax_and_scale_history`
(torchao's names) refresh now what the automatic step has not already refreshed: called
after `optimizer.step()`, or from an optimizer step hook, they add no collective.
`Float8Step.disable()` turns the automatic refresh off (the explicit calls still work).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import cast

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from fsdp_float8.core.amax_sync import Group, group_of
from fsdp_float8.core.training_forward import is_training_forward
from fsdp_float8.fsdp import refresh as _refresh
from fsdp_float8.fsdp.optimizer_params import count_step_as_write, refuse_replaced_parameters
from fsdp_float8.fsdp.refresh import Unit, grouped_units, has_work, units_of
from fsdp_float8.fsdp.step_plan import StepPlan, plan_of
from fsdp_float8.fsdp.streams import caller_stream, first_stream, on_stream
from fsdp_float8.fsdp.structure import Structure, held_by
from fsdp_float8.nn.convert import AFTER_CONVERSION
from fsdp_float8.weight_wrappers.base import BEFORE_ALL_GATHER

_AUTO, _FORWARD, _EXPLICIT = "after optimizer step", "before forward", "explicit call"
_STEP_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root module -> step
_LAYER_STEP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # float8 layer -> step


class Float8Step:
    """The float8 step of one module tree (see the module docstring). Get it with
    `float8_step(model)`; `disable()` / `enable()` switch the automatic refresh."""

    def __init__(self, model: nn.Module, *, mark: bool = True) -> None:
        self._model = weakref.ref(model)
        self._enabled = False
        self._epoch = 0  # optimizer steps begun on the model's parameters
        self._synced_epoch = -1  # the epoch of the last delayed sync
        self._stepped_epoch = -1  # the epoch whose optimizer step has completed
        self._forwards = [0, -1]  # training forwards since the last sync, its sync count
        self._stream = first_stream()  # the caller's (see `_before_all_gather`)
        self._structure: Structure | None = None
        _STEP_OF[model] = self
        if mark:
            setattr(model, "_float8_step_marker", _Marker(id(model)))  # noqa: B010

    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this Float8Step was garbage collected")
        return model

    @property
    def enabled(self) -> bool:
        return self._enabled

    def enable(self) -> Float8Step:
        """Refresh automatically after each optimizer step (and before the first forward)."""
        self._enabled = True
        _install_forward_hook(self.model)
        self._units()  # its layers now know it (the all-gather hook asks)
        return self

    def disable(self) -> Float8Step:
        """No automatic refresh: call precompute / sync yourself (each weight that finds no
        fresh precomputed scale all-reduces its own amax at its all-gather)."""
        self._enabled = False
        return self

    def describe(self) -> StepPlan:
        """The layers, weights and collectives of this step, as the model is now. The
        collectives are known after `fully_shard` (the meshes); before it, in a run of
        several ranks with float8-gathered weights, `collectives_per_step` is None."""
        return plan_of(self._units(), enabled=self._enabled)

    def structure(self) -> Structure:
        """The model's units, mesh and parameters, rebuilt only after a structural change."""
        structure = self._structure
        if structure is None or not structure.current():
            structure = self._structure = Structure.build(self.model)
            for u in structure.units:
                if u.float8:
                    _LAYER_STEP[u.module] = self
        return structure

    def _units(self) -> list[tuple[Unit, Group]]:
        structure = self.structure()
        return [(u, structure.default) for u in structure.units]

    def __repr__(self) -> str:
        return f"Float8Step({self.describe()})"


class _Marker:
    """On the model: `copy.deepcopy(model)` gets a step of its own, on or off as the
    original's (torch.compile users deep-copy a converted model; a compiled root never runs
    the forward hook that would otherwise create it). Pickles as an int."""

    def __init__(self, model_id: int) -> None:
        self.model_id = model_id

    def __deepcopy__(self, memo):
        new_model = memo.get(self.model_id)
        source = next((s for m, s in _STEP_OF.items() if id(m) == self.model_id), None)
        if isinstance(new_model, nn.Module) and source is not None:
            Float8Step(new_model, mark=False)._enabled = source._enabled
            return _Marker(id(new_model))
        return _Marker(self.model_id)


def float8_step(model: nn.Module) -> Float8Step:
    """Turn the float8 step on for `model` (any module tree holding float8 linear layers or
    float8 experts, converted here or built elsewhere) and return it; idempotent."""
    if not any(u.float8 for u in units_of(model)):
        raise ValueError(
            f"{type(model).__name__} holds no Float8Linear and no float8 experts module, so "
            "it has no float8 step; convert it first (convert_to_float8_training) or pass "
            "the module that holds the float8 layers"
        )
    step = _STEP_OF.get(model) or Float8Step(model)
    return step.enable()


def _step_for(model: nn.Module) -> Float8Step:
    """The model's step, or a disabled one for explicit calls (it never refreshes alone)."""
    return _STEP_OF.get(model) or Float8Step(model)


@torch.no_grad()
def precompute_float8_dynamic_scale_for_fsdp(module: nn.Module) -> int:
    """Store the next all-gather's scale on every dynamic tensorwise float8 weight of
    `module` (torchao's name for the model) whose scale is stale (and sync delayed state
    that is due, in the same collective); returns how many weights hold a fresh precomputed
    scale. Optional: the float8 step does it."""
    _refresh_steps([_step_for(module)], _EXPLICIT)
    return sum(1 for u, _ in _step_for(module)._units() if u.dynamic_weight() is not None)


@torch.no_grad()
def sync_float8_amax_and_scale_history(model: nn.Module, *, group: Group = None) -> int:
    """Reduce the delayed amaxes across data-parallel ranks in one collective, roll the
    histories, update the scales (and refresh stale precomputed weight scales in the same
    collective), unless the automatic float8 step already did since the last optimizer
    step. `group` defaults to the mesh of each layer's FSDP2 weight (none: a single process)
    and is remembered for later refreshes; a model with no delayed layer refuses it.
    Returns the number of delayed operands. Before the first forward it seeds every delayed
    weight's scale from the weight itself."""
    step = _step_for(model)
    units = step._units()
    states = [s for u, _ in units if (s := u.delayed()) is not None]
    if group is not None and not states:
        raise ValueError(
            f"sync_float8_amax_and_scale_history(group={group!r}): the group is where delayed "
            f"amaxes are reduced, but {type(model).__name__} holds no delayed-scaling layer, "
            "so it would change nothing (precomputed weight scales reduce over each weight's "
            "FSDP2 mesh); drop group"
        )
    if group is not None:
        for state in states:
            state.use_group(group)
    _refresh_steps([step], _EXPLICIT)
    return sum(len(state.operands) for state in states)


def _delayed_due(step: Float8Step, mode: str) -> bool:
    """Whether the step's delayed layers sync now (host state only)."""
    if mode == _AUTO:
        return step._synced_epoch != step._epoch
    if mode == _EXPLICIT:  # not when the automatic step synced after this optimizer step
        done = step._synced_epoch == step._epoch == step._stepped_epoch
        return not (step._enabled and done)
    return False  # before a forward: only unseeded weights


def _refresh_steps(steps: list[Float8Step], mode: str) -> tuple[int, int]:
    """Refresh what is stale in `steps` together: one collective per reduction group."""
    structures = [step.structure() for step in steps]
    for structure in structures:  # before the host reads: a written scale drops `ready`
        for state in structure.delayed:
            state.drop_if_scales_written()
    _refresh.read_pending_checks()
    due: set[int] = set()
    for step, structure in zip(steps, structures, strict=True):
        if structure.delayed:
            step_due = _delayed_due(step, mode)
            due.update([id(s) for s in structure.delayed if step_due or s.unseeded])
    if len(structures) == 1:  # one model: its grouping is kept while it holds
        grouped, weights = _grouped(structures[0]), structures[0].dynamic
    else:
        units: dict[tuple[int, str], tuple[Unit, Group]] = {}
        for structure in structures:
            for u in structure.units:
                # a module in two steps (a model and a converted container of it) counts once
                units.setdefault((id(u.module), u.name), (u, structure.default))
        grouped = grouped_units(list(units.values()))
        weights = [w for u, _ in units.values() if (w := u.weight) is not None]
    if mode == _FORWARD and not any(map(group_of, grouped)):
        return 0, 0  # one process: nothing a forward needs first (eager == compiled)
    # host-side integer checks per weight (no device sync)
    stale = any([w._state.fresh_scale() is None for w in weights])
    if not (stale or due or _needs_check(structures, grouped)):
        return 0, 0
    counts = _refresh.refresh_units(grouped, due, f"refresh ({mode})")
    for step, structure in zip(steps, structures, strict=True):
        if due and any([id(s) in due for s in structure.delayed]):
            step._synced_epoch = step._epoch
    return counts


def _grouped(structure: Structure) -> dict[Group, list[Unit]]:
    """The structure's units by reduction group, kept while the delayed states' explicit
    sync groups (`use_group`) stay as they were."""
    key = [s.sync_group for s in structure.delayed] if structure.delayed else []
    kept = structure.memo.get("grouped")
    if kept is not None and kept[0] == key:
        return kept[1]
    grouped = grouped_units([(u, structure.default) for u in structure.units])
    structure.memo["grouped"] = (key, grouped)
    return grouped


def _needs_check(structures: list[Structure], grouped: dict[Group, list[Unit]]) -> bool:
    """`refresh.needs_check`, remembered once false for a structure (its modules stay
    checked: the checked set only grows, and the structure holds them)."""
    if len(structures) == 1:
        if structures[0].memo.get("checked"):
            return False
    elif all([st.memo.get("checked") for st in structures]):
        return False
    if _refresh.needs_check(grouped):
        return True
    for st in structures:
        st.memo["checked"] = True
    return False


# -- when: the optimizer step hooks and the root forward hook ---------------------------------
def _held_steps(optimizer: torch.optim.Optimizer) -> list[Float8Step]:
    return held_by(optimizer, _STEP_OF) if _STEP_OF else []


def _before_optimizer_step(optimizer, args, kwargs) -> None:
    refuse_replaced_parameters(optimizer)
    held = _held_steps(optimizer)
    if held:
        count_step_as_write(optimizer)
    for step in held:
        step._epoch += 1


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    held = _held_steps(optimizer)
    enabled = [s for s in held if s._enabled]
    if enabled:
        _refresh_steps(enabled, _AUTO)
    for step in held:
        step._stepped_epoch = step._epoch


register_optimizer_step_pre_hook(_before_optimizer_step)
register_optimizer_step_post_hook(_after_optimizer_step)


def _install_forward_hook(model: nn.Module) -> None:
    if not any(h is _before_forward for h in model._forward_pre_hooks.values()):
        model.register_forward_pre_hook(_before_forward, prepend=True)


def _before_forward(module: nn.Module, args) -> None:
    if torch.compiler.is_compiling():  # traced: nothing (the optimizer hook refreshes)
        return
    _before_forward_eager(module)


@torch._dynamo.disable
def _before_forward_eager(module: nn.Module) -> None:
    hooks = module._forward_pre_hooks
    first = next(iter(hooks))
    if hooks[first] is not _before_forward:  # fully_shard prepended its root hook: go first
        key = next(k for k, h in hooks.items() if h is _before_forward)
        cast(OrderedDict, hooks).move_to_end(key, last=False)
    if not is_training_forward(module):
        return  # an evaluation forward (or pipelining's shape inference) starts no collective
    step = _STEP_OF.get(module) or float8_step(module)  # a deep copy has no step yet
    if not step._enabled:
        return
    step._stream = caller_stream()
    _refresh_steps([step], _FORWARD)
    _count_forward(step)


def _before_all_gather(module: nn.Module) -> None:
    """A weight about to be all-gathered with no fresh scale (the first forward of a
    converted container, a checkpoint load since the last step): refresh its whole model
    now, one collective, rather than one all-reduce per weight."""
    step = _LAYER_STEP.get(module)
    if step is not None and step._enabled:
        with on_stream(step._stream):
            _refresh_steps([step], _FORWARD)


BEFORE_ALL_GATHER.append(_before_all_gather)
AFTER_CONVERSION.append(float8_step)


def _count_forward(step: Float8Step) -> None:
    # counted outside any compiled region and never by an activation-checkpoint recompute
    # (which does not go through the root's forward)
    structure = step._structure  # checked by the refresh just before
    states = (structure if structure is not None else step.structure()).delayed
    if not states:
        return
    counter = step._forwards
    if counter[1] != states[0].syncs:  # synced since the last forward (hook or explicit)
        counter[:] = [0, states[0].syncs]
    counter[0] += 1
    n, limit = counter[0], min(s.max_forwards_without_sync for s in states)
    if n > limit:
        raise RuntimeError(
            f"{n} training forwards since the last delayed-scaling sync: delayed scales are "
            "stale. The float8 step syncs after each step of a torch.optim optimizer that "
            "holds the model's parameters; with another optimizer call "
            "sync_float8_amax_and_scale_history(model) after each step, or raise "
            "DelayedScalingConfig.max_forwards_without_sync for long gradient accumulation"
        )


__all__ = [
    "Float8Step",
    "StepPlan",
    "float8_step",
    "has_work",
    "precompute_float8_dynamic_scale_for_fsdp",
    "sync_float8_amax_and_scale_history",
]
