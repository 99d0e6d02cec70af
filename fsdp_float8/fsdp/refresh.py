"""The refresh collective of the float8 step: every stale scale of a model in one vector.

A *unit* is one weight parameter of a linear layer or of a float8 experts module. Per unit
the vector holds five float32 slots (weight amax, input amax, grad_output amax, ran,
-ran); its length depends only on the model's structure (plain `nn.Linear`s get a unit of
zeros too), never on rank-local state. One collective per reduction group:
- a gathered weight whose shard's cast needs the whole weight's amax (a `RefreshedWeight`:
  dynamic tensorwise float8, linear or expert, or 4-bit) gets the stamp its class derives
  from the reduced amax (`stamps_from_amaxes`: a precomputed float8 scale, or the amax
  itself), stamped into its wrapper (`RefreshedWeight.set_precomputed_scale`);
- a delayed-scaling layer's recorded amaxes are reduced, its histories rolled
  (`DelayedScalingState.apply_reduced`). A MAX over ranks of `ran` and `-ran` tells on the
  device whether the layer ran everywhere (roll), nowhere (keep), or on some ranks only (an
  error on every rank, not a hang).
A refresh that issues a collective is preceded by the store handshake of `rank_agreement`
(the first one of a group also compares the config fingerprints): a rank that is missing
(it skipped the optimizer step, never converted, ...) or converted differently gets an
error, not an abort. A group with nothing to reduce issues no collective and has no
handshake after its first refresh.

What is stale is decided by the caller (`fsdp_float8.fsdp.step`), on the host.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_float8.core.amax_sync import Group, all_reduce_amax_, group_of
from fsdp_float8.core.config import Operand
from fsdp_float8.core.delayed_state import DelayedScalingState
from fsdp_float8.core.scaling import tensor_amaxes
from fsdp_float8.fsdp.rank_agreement import fingerprint, handshake
from fsdp_float8.weight_wrappers.base import Float8WeightWrapper
from fsdp_float8.weight_wrappers.refreshed import RefreshedWeight

_SLOTS = (Operand.WEIGHT, Operand.INPUT, Operand.GRAD_OUTPUT)  # then ran, -ran
_checked: weakref.WeakSet = weakref.WeakSet()  # modules whose ranks were found to agree


class Float8Module(Protocol):
    """What the float8 step asks a module, instead of checking its class (so `fsdp/` imports
    neither `nn/` nor `experts/`): the names of its float8-cast weights (`Float8Linear`:
    `("weight",)`; float8 experts: each 3-D weight). A float8 linear also holds its delayed
    state as `delayed_scaling` (None without delayed scaling)."""

    float8_weight_names: tuple[str, ...]


def float8_weight_names(module: nn.Module) -> tuple[str, ...] | None:
    """The module's float8-cast weights, or None for a module the float8 step only counts."""
    return getattr(module, "float8_weight_names", None)


@dataclass(frozen=True, eq=False)
class Unit:
    """One weight of the sync vector: `module.<name>` (a linear's weight, an expert weight)."""

    fqn: str  # the parameter's name in the model, e.g. "layers.0.attention.wq.weight"
    module: nn.Module
    name: str
    float8: bool = False  # a weight of a `Float8Module`

    @property
    def layer(self) -> str:
        """The fqn of the module that holds the weight ("" for a root layer)."""
        return self.fqn.rpartition(".")[0]

    @property
    def param(self) -> torch.Tensor:
        return getattr(self.module, self.name)

    def dynamic_weight(self) -> RefreshedWeight | None:
        """The wrapper of a gathered weight whose stamp the refresh computes from the whole
        weight's amax (a precomputed float8 scale, a 4-bit tensor amax)."""
        if not self.float8:
            return None
        w = self.param
        local = w._local_tensor if isinstance(w, DTensor) else w
        if isinstance(local, RefreshedWeight) and local.needs_global_amax:
            return local
        return None

    def delayed(self) -> DelayedScalingState | None:
        return getattr(self.module, "delayed_scaling", None) if self.float8 else None

    # `dynamic_weight()` and `delayed()` resolved once (attributes: no call per read). The
    # float8 step reads them of the units of a current `Structure` only, whose parameters
    # and their local tensors are the objects they were when it was built.
    @cached_property
    def weight(self) -> RefreshedWeight | None:
        return self.dynamic_weight()

    @cached_property
    def state(self) -> DelayedScalingState | None:
        return self.delayed()


def units_of(model: nn.Module) -> list[Unit]:
    """Every weight a `Float8Module` names and every other nn.Linear weight of `model`, in
    module order."""
    units = []
    for fqn, m in model.named_modules():
        prefix = f"{fqn}." if fqn else ""
        names = float8_weight_names(m)
        if names is not None:
            units += [Unit(prefix + n, m, n, float8=True) for n in names]
        elif isinstance(m, nn.Linear):
            units.append(Unit(prefix + "weight", m, "weight"))
    return units


def has_work(unit: Unit) -> bool:
    """Whether the unit ever needs the refresh collective (a precomputed or delayed scale)."""
    return unit.dynamic_weight() is not None or unit.delayed() is not None


def needs_check(grouped: dict[Group, list[Unit]]) -> bool:
    """Whether a group holds float8 units whose ranks were not checked yet."""
    return any(
        group_of(group) is not None and any(u.float8 and u.module not in _checked for u in us)
        for group, us in grouped.items()
    )


def group_for(unit: Unit, default: Group) -> Group:
    """Where a unit's amaxes are reduced: an explicit delayed sync group, else its weight's
    FSDP2 mesh, else the model's (a weight FSDP2 holds unsharded right now, or no FSDP2)."""
    state = unit.state
    if state is not None and state.sync_group is not None:
        return state.sync_group
    w = getattr(unit.module, unit.name)
    return w.device_mesh if isinstance(w, DTensor) else default


def mesh_of(params: Iterable[torch.Tensor]) -> Group:
    """The mesh of the first FSDP2 (DTensor) parameter, None when there is none."""
    for p in params:
        if isinstance(p, DTensor):
            return p.device_mesh
    return None


def grouped_units(units: list[tuple[Unit, Group]]) -> dict[Group, list[Unit]]:
    """(unit, the default group of its model) -> units by reduction group, in order."""
    groups: dict[Group, list[Unit]] = {}
    for u, default in units:
        groups.setdefault(group_for(u, default), []).append(u)
    return groups


def collectives(grouped: dict[Group, list[Unit]]) -> int:
    """Refresh collectives a step with work in every unit would issue: one per group that
    spans more than one rank and holds a unit with a precomputed or delayed scale."""
    return sum(1 for g, us in grouped.items() if group_of(g) is not None and any(map(has_work, us)))


@torch.no_grad()
def refresh_units(
    grouped: dict[Group, list[Unit]], delayed_due: set[int], handshake_at: str | None = None
) -> tuple[int, int]:
    """Refresh every dynamic weight of the units and sync the delayed layers whose state's
    id is in `delayed_due`: one collective per reduction group. `handshake_at` (what the
    refresh is, for errors) asks for the store handshake before each collective; the
    first refresh of a group always has one. Returns (weights, delayed operands)."""
    counts = [0, 0]
    for group, members in grouped.items():
        n_weights, n_delayed = _refresh_group(members, group, delayed_due, handshake_at)
        counts[0] += n_weights
        counts[1] += n_delayed
    return counts[0], counts[1]


def _refresh_group(units: list[Unit], group: Group, delayed_due: set[int], at: str | None):
    work = any([u.weight is not None or id(u.state) in delayed_due for u in units])
    _agree(units, group, at if work else None)
    if not work:  # nothing to reduce (e.g. rowwise)
        return 0, 0
    columns, weights, states = _slot_columns(units, delayed_due)
    reduced = all_reduce_amax_(torch.cat([*columns, -columns[len(_SLOTS)]]), group)
    table = reduced.view(len(_SLOTS) + 2, len(units))
    _stamp_scales(weights, table[0])
    _apply_delayed(units, states, table)
    return len(weights), sum([len(s.operands) for i in states if (s := units[i].state)])


def _stamp_scales(weights: list[tuple[int, RefreshedWeight]], amaxes: torch.Tensor) -> None:
    """Each weight's stamp from its reduced amax (`amaxes[i]`), as its class says
    (`stamps_from_amaxes`: a precomputed scale or the amax, with its inverse when the class
    asks), once per (rule, float8 dtype, power-of-two rule) over all its weights."""
    by_rule: dict[tuple, list[tuple[int, RefreshedWeight]]] = {}
    for i, w in weights:
        cls, cast = type(w), w._cast
        rule = (cls.stamps_from_amaxes, cls.STAMPS_INVERSE, cast.float8_dtype, cast.power_of_2)
        by_rule.setdefault(rule, []).append((i, w))
    for (stamps_from, with_inverse, dtype, pow2), members in by_rule.items():
        index = torch.tensor([i for i, _ in members], device=amaxes.device)
        stamps = stamps_from(amaxes[index], dtype, pow2)
        if not with_inverse:
            for (_, w), stamp in zip(members, stamps.unbind(), strict=True):
                w.set_precomputed_scale(stamp)
            continue
        # the GEMMs multiply by 1 / scale: one op here, none per GEMM. Each weight's stamp
        # is one row (scale, 1 / scale): the one record of both, from here to the GEMM
        pairs = torch.stack((stamps, stamps.reciprocal()), dim=1).unbind()
        for (_, w), pair in zip(members, pairs, strict=True):
            w.set_precomputed_scale(pair[0], pair)


def _agree(units: list[Unit], group: Group, at: str | None) -> None:
    """The store handshake before a refresh collective (`at` names the refresh), and the
    config check at a group's first refresh."""
    pg = group_of(group)
    if pg is None or dist.get_world_size(pg) == 1:
        return
    check = not all([u.module in _checked for u in units if u.float8])
    if check or at:
        head = fingerprint([(u.fqn, u.module, u.name) for u in units]) if check else None
        handshake(pg, head, at or "first refresh of the float8 step")
        if check:
            _checked.update([u.module for u in units if u.float8])


def _slot_columns(units: list[Unit], delayed_due: set[int]):
    """The sync vector's columns: per slot, one value per unit (0 where unused)."""
    device = _device_of(units)
    zero = torch.zeros((), dtype=torch.float32, device=device)
    cols: list[list[torch.Tensor]] = [[zero] * len(units) for _ in range(len(_SLOTS) + 1)]
    weights = [(i, w) for i, u in enumerate(units) if (w := u.weight) is not None]
    for (i, _), amax in zip(weights, tensor_amaxes([w._tensor for _, w in weights]), strict=True):
        cols[0][i] = amax.reshape(())
    states = [i for i, u in enumerate(units) if id(u.state) in delayed_due]
    for i in states:
        state = units[i].state
        assert state is not None  # `states` holds the delayed units only
        slots = state.slots(_local_hp_weight(units[i].param))
        for k, op in enumerate(_SLOTS):
            if op in slots:
                cols[k][i] = slots[op].to(device)
        cols[len(_SLOTS)][i] = slots["ran"].to(device)
    return [torch.stack(c) for c in cols], weights, states


def _apply_delayed(units: list[Unit], states: list[int], table: torch.Tensor) -> None:
    ran_max, ran_min = table[len(_SLOTS)], -table[len(_SLOTS) + 1]
    for i in states:
        state = units[i].state
        assert state is not None  # `states` holds the delayed units only
        amaxes = {op: table[k, i] for k, op in enumerate(_SLOTS) if op in state.operands}
        state.apply_reduced(amaxes, ran_min[i] > 0)
    if states:  # units that are not synced hold zeros on every rank: never mixed
        names = [u.layer for u in units]
        _read_later(ran_max != ran_min, functools.partial(_raise_if_mixed, names))
        _read_ready_flags([s for i in states if (s := units[i].state) is not None])


def _read_ready_flags(states: list[DelayedScalingState]) -> None:
    """Queue a host read of the `initialized` flags the host has not seen True yet; each
    that reads True makes its operand `ready` (`DelayedScalingState.mark_ready`): its cast
    then takes the synced scale without waiting for its own amax."""
    waiting = [(state, state.unready(), state.epoch) for state in states if state.unready()]
    if not waiting:
        return
    flags = torch.stack([state.view(op).initialized for state, ops, _ in waiting for op in ops])

    def mark(values: list[bool]) -> None:
        at = 0
        for state, ops, epoch in waiting:
            state.mark_ready(ops, values[at : at + len(ops)], epoch)
            at += len(ops)

    _read_later(flags, mark)


# rank -> its (event, flags, reader) not read yet: per rank, so ranks that share a process
# (torch's threaded test process group) each read their own
_pending_checks: dict[int, list[tuple[torch.Event, torch.Tensor, Callable]]] = {}


def _pending() -> list[tuple[torch.Event, torch.Tensor, Callable]]:
    rank = dist.get_rank() if dist.is_initialized() else -1
    return _pending_checks.setdefault(rank, [])


def _read_later(flags: torch.Tensor, reader: Callable[[list[bool]], None]) -> None:
    """Hand `flags` (bool, on the device) to `reader` as a list without a device sync: on
    CPU now (`tolist` is a plain read), on an accelerator through a non-blocking copy that
    a later refresh reads once it has landed (a step late). Every rank holds the same
    reduced flags, so every rank reads alike."""
    if flags.device.type == "cpu":
        reader(flags.tolist())
        return
    host = torch.empty(flags.shape, dtype=torch.bool, pin_memory=True)
    host.copy_(flags, non_blocking=True)
    event = torch.Event(flags.device)
    event.record()
    _pending().append((event, host, reader))


def read_pending_checks() -> None:
    if not _pending_checks:  # none was ever queued (a CPU run): nothing to read
        return
    pending = _pending()
    while pending and pending[0][0].query():
        _, host, reader = pending.pop(0)
        reader(host.tolist())


def _raise_if_mixed(names: list[str], mixed: list[bool]) -> None:
    bad = sorted({name for name, m in zip(names, mixed, strict=True) if m})
    if bad:
        raise ValueError(
            f"delayed-scaling layers {bad} ran a training forward on some ranks but not on "
            "others since the last sync: every rank must run the same layers between syncs "
            "(their amaxes were not used)"
        )


def _device_of(units: list[Unit]) -> torch.device:
    return getattr(units[0].module, units[0].name).device if units else torch.device("cpu")


def _local_hp_weight(weight: torch.Tensor) -> torch.Tensor:
    local = weight._local_tensor if isinstance(weight, DTensor) else weight
    return local._tensor if isinstance(local, Float8WeightWrapper) else local
