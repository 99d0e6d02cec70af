"""The float8 step: refresh what the optimizer changed, in one collective, before a forward.

What goes stale after `optimizer.step()`:
- the precomputed scale of a dynamic tensorwise float8-gathered weight (without it, the
  next all-gather all-reduces each weight's amax on its own);
- delayed scaling: the amaxes recorded since the last sync must be reduced across ranks,
  rolled into the histories and turned into the next scales (`delayed_state`).

`refresh(model)` does both for every layer, in ONE collective per reduction group: a
float32 vector of five slots per linear layer (weight amax, input amax, grad_output amax,
ran, -ran) whose length depends only on the model's structure, never on rank-local state.
A MAX over ranks of `ran` and `-ran` tells on the device whether a layer ran everywhere
(roll), nowhere (keep), or on some ranks only (an error on every rank, not a hang). The
first collective of a group is an all_gather that also carries the config fingerprint
(`rank_agreement`): ranks that converted differently are named in a ValueError.

Who calls it:
- the root forward pre-hook that `convert_to_float8_training` installs
  (`install_refresh_hook`): before each forward of the converted root; when nothing changed
  it issues no collective and reads nothing from the device;
- `precompute_float8_dynamic_scale_for_fsdp(model)` and
  `sync_float8_amax_and_scale_history(model)` (torchao's names), for users who want the
  timing in their hands: they refresh now, and the hook then finds nothing to do.

"Changed" is host state only: a weight's precomputed scale is stale when its wrapper says so
(`has_fresh_precomputed_scale()`) or a torch.optim optimizer stepped since its refresh (a
global step post hook counts steps); a delayed layer is due when an optimizer stepped since
its last sync, or its weight was never seeded.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from fsdp_float8.core.amax_sync import Group, all_reduce_amax_, gather_rows, group_of
from fsdp_float8.core.config import Operand
from fsdp_float8.core.scaling import tensor_amaxes
from fsdp_float8.fsdp.delayed_state import DelayedScalingState
from fsdp_float8.fsdp.rank_agreement import FIELDS, check_agreement, fingerprint
from fsdp_float8.fsdp.weight_wrappers import DynamicFloat8Weight, Float8WeightWrapper
from fsdp_float8.nn.linear import Float8Linear

_SLOTS = (Operand.WEIGHT, Operand.INPUT, Operand.GRAD_OUTPUT)  # then ran, -ran
_steps = [0]  # torch.optim steps taken in this process (any optimizer)
_step_hook: list[RemovableHandle] = []
_refreshed_at: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> step
_checked: weakref.WeakSet = weakref.WeakSet()  # layers whose ranks were found to agree


def optimizer_steps() -> int:
    """How many torch.optim optimizer steps this process has taken (host counter)."""
    if not _step_hook:
        hook = register_optimizer_step_post_hook(_count_step)
        _step_hook.append(hook)
    return _steps[0]


def _count_step(optimizer, args, kwargs) -> None:
    _steps[0] += 1


@torch.no_grad()
def precompute_float8_dynamic_scale_for_fsdp(model: nn.Module) -> int:
    """Store the next all-gather's scale on every dynamic tensorwise float8 weight (and
    sync delayed state, in the same collective); returns how many weights. Optional with
    `convert_to_float8_training`, whose hook does it before the next forward."""
    return refresh(model, force=True)[0]


@torch.no_grad()
def sync_float8_amax_and_scale_history(model: nn.Module, *, group: Group = None) -> int:
    """Reduce all delayed amaxes across data-parallel ranks in one collective, roll the
    histories, update the scales (and refresh precomputed weight scales in the same
    collective). `group` defaults to the mesh of each layer's FSDP2 weight (none: a single
    process) and is remembered for later automatic refreshes. Returns the number of
    delayed operands reduced. Before the first forward it seeds every delayed weight's
    scale from the weight itself, so the first all-gather needs no amax all-reduce."""
    if group is not None:
        for m in _float8_linears(model):
            if m.delayed_scaling is not None:
                m.delayed_scaling.use_group(group)
    return refresh(model, force=True)[1]


def install_refresh_hook(model: nn.Module) -> None:
    """Run `refresh(model)` before each forward of `model` (the converted root), ahead of
    the FSDP2 all-gathers; idempotent. A no-op forward when nothing changed."""
    if getattr(model, "_float8_refresh_hook", None) is not None:
        return
    step = optimizer_steps()
    for m in _float8_linears(model):
        if m.delayed_scaling is not None:
            m.delayed_scaling.start_counting_steps_at(step)
    handle = model.register_forward_pre_hook(_refresh_before_forward, prepend=True)
    model._float8_refresh_hook = handle  # type: ignore[assignment]
    # training forwards since the last sync, its marker
    model._float8_forwards = [0, None]  # type: ignore[assignment]


@torch._dynamo.disable
def _refresh_before_forward(module: nn.Module, args) -> None:
    hooks = cast(OrderedDict, module._forward_pre_hooks)
    key = cast(RemovableHandle, module._float8_refresh_hook).id
    if next(iter(hooks)) != key:  # fully_shard prepended its own root hook: go first
        hooks.move_to_end(key, last=False)
    refresh(module)
    if module.training and torch.is_grad_enabled():
        _count_forward(module)


def _count_forward(module: nn.Module) -> None:
    # counted here, outside any compiled region and never by an activation-checkpoint
    # recompute (which does not go through the root's forward)
    states = [m.delayed_scaling for m in _float8_linears(module) if m.delayed_scaling]
    if not states:
        return
    counter = cast(list, module._float8_forwards)
    if counter[1] != states[0].syncs:  # synced since the last forward (hook or explicit)
        counter[:] = [0, states[0].syncs]
    counter[0] += 1
    n, limit = counter[0], min(s.max_forwards_without_sync for s in states)
    if n > limit:
        raise RuntimeError(
            f"{n} training forwards since the last delayed-scaling sync: delayed scales are "
            "stale. The automatic refresh syncs after each torch.optim optimizer step; with "
            "another optimizer call sync_float8_amax_and_scale_history(model) after each "
            "step, or raise DelayedScalingConfig.max_forwards_without_sync for long "
            "gradient accumulation"
        )


@torch.no_grad()
def refresh(model: nn.Module, *, force: bool = False) -> tuple[int, int]:
    """Refresh every stale precomputed weight scale and due delayed sync of `model`, one
    collective per reduction group; nothing (no collective, no device read) when nothing is
    stale or due and the ranks were already checked. Returns (weights, delayed operands)."""
    _read_pending_checks()
    linears = _linears(model)
    steps = optimizer_steps()
    default = _mesh_of(model)
    if not force and not any(_stale(m, steps, default) for _, m in linears):
        return 0, 0
    groups: dict[Group, list[tuple[str, nn.Module]]] = {}
    for fqn, m in linears:
        groups.setdefault(_group_of_layer(m, default), []).append((fqn, m))
    counts = [0, 0]
    for group, members in groups.items():
        n_weights, n_delayed = _refresh_group(members, group, steps)
        counts[0] += n_weights
        counts[1] += n_delayed
    return counts[0], counts[1]


def _refresh_group(members: list[tuple[str, nn.Module]], group: Group, steps: int):
    modules = [m for _, m in members]
    columns, weights, states = _slot_columns(modules)
    ran = columns[len(_SLOTS)]
    vector = torch.cat([*columns, -ran])
    if group_of(group) is not None and not all(m in _checked for m in modules):
        head = fingerprint(members).to(vector.device)
        rows = gather_rows(torch.cat([head, vector.to(torch.float64)]), group)
        check_agreement(rows[:, : len(FIELDS)], group_of(group))
        reduced = rows[:, len(FIELDS) :].amax(dim=0).to(torch.float32)
        _checked.update(modules)
    else:
        reduced = all_reduce_amax_(vector, group)
    table = reduced.view(len(_SLOTS) + 2, len(modules))
    for i, w in weights:
        m = modules[i]
        scale = w.strategy.scale_from_amax(table[0, i], w.float8_dtype)  # reduced above
        w.set_precomputed_scale(scale)
        _refreshed_at[m] = steps
    _apply_delayed(modules, states, table, steps)
    return len(weights), sum(len(modules[i].delayed_scaling.operands) for i in states)


def _slot_columns(modules: list[nn.Module]):
    """The sync vector's columns: per slot, one value per linear (0 where unused)."""
    device = _device_of(modules)
    zero = torch.zeros((), dtype=torch.float32, device=device)
    cols: list[list[torch.Tensor]] = [[zero] * len(modules) for _ in range(len(_SLOTS) + 1)]
    weights = []
    for i, m in enumerate(modules):
        w = _dynamic_weight(m)
        if w is not None:
            weights.append((i, w))
    for (i, _), amax in zip(weights, tensor_amaxes([w._tensor for _, w in weights]), strict=True):
        cols[0][i] = amax.reshape(())
    states = [i for i, m in enumerate(modules) if _delayed(m) is not None]
    for i in states:
        state = _delayed(modules[i])
        assert state is not None
        slots = state.slots(_local_hp_weight(modules[i].get_parameter("weight")))
        for k, op in enumerate(_SLOTS):
            if op in slots:
                cols[k][i] = slots[op].to(device)
        cols[len(_SLOTS)][i] = slots["ran"].to(device)
    return [torch.stack(c) for c in cols], weights, states


def _apply_delayed(modules, states: list[int], table: torch.Tensor, steps: int) -> None:
    ran_max, ran_min = table[len(_SLOTS)], -table[len(_SLOTS) + 1]
    for i in states:
        state = modules[i].delayed_scaling
        amaxes = {op: table[k, i] for k, op in enumerate(_SLOTS) if op in state.operands}
        state.apply_reduced(amaxes, ran_min[i] > 0, steps)
    if states:  # layers that are not delayed hold zeros on every rank: never mixed
        _check_ran_everywhere([_fqn_of(m) for m in modules], ran_max != ran_min)


_pending_checks: list[tuple[torch.Event, torch.Tensor, list[str]]] = []  # (event, flags, names)


def _check_ran_everywhere(names: list[str], mixed: torch.Tensor) -> None:
    """Every rank holds the same reduced flags, so every rank raises. Read without a device
    sync: on CPU now (`tolist` is a plain read), on an accelerator through a non-blocking
    copy that a later refresh reads once it has landed (the error comes a step late)."""
    if mixed.device.type == "cpu":
        _raise_if_mixed(names, mixed.tolist())
        return
    host = torch.empty(mixed.shape, dtype=torch.bool, pin_memory=True)
    host.copy_(mixed, non_blocking=True)
    event = torch.Event(mixed.device)
    event.record()
    _pending_checks.append((event, host, names))


def _read_pending_checks() -> None:
    while _pending_checks and _pending_checks[0][0].query():
        _, host, names = _pending_checks.pop(0)
        _raise_if_mixed(names, host.tolist())


def _raise_if_mixed(names: list[str], mixed: list[bool]) -> None:
    bad = sorted({name for name, m in zip(names, mixed, strict=True) if m})
    if bad:
        raise ValueError(
            f"delayed-scaling layers {bad} ran a training forward on some ranks but not on "
            "others since the last sync: every rank must run the same layers between syncs "
            "(their amaxes were not used)"
        )


def _stale(m: nn.Module, steps: int, default: Group) -> bool:
    if not isinstance(m, Float8Linear):
        return False
    if m not in _checked and group_of(_group_of_layer(m, default)) is not None:
        return True  # the ranks' agreement is checked at the first refresh
    w = _dynamic_weight(m)
    if w is not None and (not w.has_fresh_precomputed_scale() or _refreshed_at.get(m) != steps):
        return True
    state = m.delayed_scaling
    return state is not None and state.due(steps)


def _dynamic_weight(m: nn.Module) -> DynamicFloat8Weight | None:
    if not isinstance(m, Float8Linear):
        return None
    w = m.weight
    local = w._local_tensor if isinstance(w, DTensor) else w
    if isinstance(local, DynamicFloat8Weight) and not local.rowwise:
        return local
    return None


def _delayed(m: nn.Module) -> DelayedScalingState | None:
    return m.delayed_scaling if isinstance(m, Float8Linear) else None


def _group_of_layer(m: nn.Module, default: Group) -> Group:
    """Where a layer's amaxes are reduced: an explicit sync group, else its weight's FSDP2
    mesh, else the model's (a weight FSDP2 holds unsharded right now, or no FSDP2)."""
    state = _delayed(m)
    if state is not None and state.sync_group is not None:
        return state.sync_group
    w = getattr(m, "weight", None)
    return w.device_mesh if isinstance(w, DTensor) else default


def _mesh_of(model: nn.Module) -> Group:
    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh
    return None


def _device_of(modules: list[nn.Module]) -> torch.device:
    for m in modules:
        w = getattr(m, "weight", None)
        if w is not None:
            return w.device
    return torch.device("cpu")


_linears_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every nn.Linear of the model (Float8Linear included), by name: the sync vector's
    layout, the same on every rank that built the same model."""
    cached = _linears_cache.get(model)
    if cached is None:
        cached = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        _linears_cache[model] = cached
        for fqn, m in cached:
            _names[m] = fqn
    return cached


_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fqn_of(m: nn.Module) -> str:
    return _names.get(m, type(m).__name__)


def _float8_linears(model: nn.Module) -> list[Float8Linear]:
    return [m for _, m in _linears(model) if isinstance(m, Float8Linear)]


def _local_hp_weight(weight: torch.Tensor) -> torch.Tensor:
    local = weight._local_tensor if isinstance(weight, DTensor) else weight
    return local._tensor if isinstance(local, Float8WeightWrapper) else local


__all__ = [
    "install_refresh_hook",
    "precompute_float8_dynamic_scale_for_fsdp",
    "refresh",
    "sync_float8_amax_and_scale_history",
]
