"""Delayed scaling state: everything a layer keeps for delayed scaling, in one small module.

Mental model. A delayed-scaled operand is cast with a scale computed at the last *sync*
from a history of past amaxes, so the cast needs no amax of its own tensor first. Between
syncs every training cast records `max(amax seen, amax now)` into `fp8_amax_<op>`; a sync
reduces those amaxes across the data-parallel ranks (one collective for the whole model,
`fsdp_float8.fsdp.step`), rolls `fp8_amax_history_<op>` (newest first) and recomputes
`fp8_scale_<op>` from it, identically on every rank. Before the first sync there is no
history (`fp8_initialized_<op>` False): the operand is scaled by its own amax, as dynamic
scaling would, and that amax is recorded like any other. A non-finite amax (inf/NaN in
the operand) is never recorded: it is counted in `fp8_nonfinite_<op>` instead
(`nonfinite_amaxes(model)`), so one bad batch that a training loop skips cannot poison
the history. A sync whose reduced amax is 0 (nothing finite recorded, or an all-zero
operand) leaves that operand's history and scale as they were.

`DelayedScalingState` is that state for one `Float8Linear` (its child `delayed_scaling`,
None when no operand is delayed):
- buffers per delayed operand, always float32 (bool for `initialized`): `.to(bfloat16)`
  leaves them alone, `to_empty()` after meta init resets them;
- `fp8_forwards` (not saved): training forwards since the last sync, counted on the
  device, so a compiled forward reads no host counter (one graph for any number of
  micro-batches) and the sync knows, per rank, which layers ran;
- host flags: `weight_ready` (the weight's scale was seeded or synced, so a float8
  all-gather can use it without a collective; refreshed by a load hook, so no forward or
  hook reads a device flag), `syncs` (how many syncs so far);
- the scale source of a delayed float8-gathered weight (`weight_scale`), the views the
  casts use (`views`), and the sync's two halves (`slots`, `apply_reduced`).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
from torch import nn

from fsdp_float8.core.amax_sync import Group
from fsdp_float8.core.config import Float8LinearConfig
from fsdp_float8.core.gemms import OPERANDS, PRIMARY_GEMM, Operand
from fsdp_float8.core.scaling import DelayedScaling, tensor_amax
from fsdp_float8.core.training_forward import (  # noqa: F401  (part of this API)
    in_pipeline_shape_inference,
    is_training_forward,
    shape_inference_codes,
)

_KINDS = ("amax", "amax_history", "scale", "initialized")


class DelayedState(NamedTuple):
    """One operand's delayed state: views of a `DelayedScalingState`'s buffers."""

    amax: torch.Tensor  # () float32: max amax recorded since the last sync
    amax_history: torch.Tensor  # (history_len,) float32, most recent first
    scale: torch.Tensor  # () float32: the scale used until the next sync
    initialized: torch.Tensor  # () bool: a sync has happened
    nonfinite: torch.Tensor | None = None  # () float32: non-finite amaxes left out
    # host: the host knows `initialized` holds (read after a sync, without a device wait):
    # the cast takes `scale` as it is, so it joins the kernel that reads its tensor
    ready: bool = False
    inverse: torch.Tensor | None = None  # () float32: 1 / scale, made with it
    # () float32: the layer's training-forward count, which this operand's record bumps
    forwards: torch.Tensor | None = None

    def record(self, amax: torch.Tensor) -> None:
        """Keep the max of the amaxes seen since the last sync. A non-finite amax (a batch
        holding inf/NaN, which a training loop's guard skips) is left out and counted, so
        it never reaches the history: the next steps scale as if it had never been seen."""
        finite = torch.isfinite(amax)
        self.amax.copy_(torch.where(finite, torch.maximum(self.amax, amax), self.amax))
        if self.nonfinite is not None:
            self.nonfinite.add_((~finite).to(self.nonfinite.dtype))
        if self.forwards is not None:  # 1 for any amax (NaN != -1): read from the amax, the
            # count joins the kernel that records it instead of a kernel of its own
            self.forwards.add_((amax != -1).to(self.forwards.dtype))

    def roll(
        self,
        amax: torch.Tensor,
        strategy: DelayedScaling,
        dtype: torch.dtype,
        *,
        where: torch.Tensor | bool = True,
    ) -> None:
        """Push the (cross-rank reduced) amax into the history and refresh the scale, where
        `where` holds (a 0-d bool, decided on the device) and the amax is finite and above
        0; the recorded amax is cleared. An amax of 0 says nothing about the next steps'
        range (an all-zero operand, or one whose every amax since the last sync was
        non-finite and left out): pushed, it would become the largest scale, and the next
        cast of that operand would saturate everywhere, so history and scale stay."""
        history = torch.roll(self.amax_history, 1)
        history[0] = amax
        source = history.amax() if strategy.scale_fn_name == "max" else history[0]
        scale = strategy.scale_from_amax(source, dtype)
        where = torch.as_tensor(where, device=history.device) & torch.isfinite(amax) & (amax > 0)
        self.amax_history.copy_(torch.where(where, history, self.amax_history))
        self.scale.copy_(torch.where(where, scale, self.scale))
        if self.inverse is not None:
            self.inverse.copy_(self.scale.reciprocal())
        self.initialized.copy_(self.initialized | where)
        self.amax.zero_()


class DelayedScalingState(nn.Module):
    """The delayed-scaling buffers and host flags of one layer (see the module docstring)."""

    fp8_forwards: torch.Tensor  # a buffer (registered in __init__)

    def __init__(self, config: Float8LinearConfig, device: torch.device | None = None):
        super().__init__()
        self.strategies: dict[Operand, DelayedScaling] = {}
        self.dtypes: dict[Operand, torch.dtype] = {}
        for op in OPERANDS:
            strategy = config.strategy(op, PRIMARY_GEMM[op])
            if isinstance(strategy, DelayedScaling):
                self.strategies[op] = strategy
                self.dtypes[op] = config.float8_dtype(op, PRIMARY_GEMM[op])
        self.operands: tuple[Operand, ...] = tuple(self.strategies)
        self.max_forwards_without_sync = config.delayed_scaling_config.max_forwards_without_sync
        n = config.delayed_scaling_config.history_len
        f32 = torch.float32
        for op in self.operands:
            self.register_buffer(f"fp8_amax_{op.value}", torch.zeros((), dtype=f32, device=device))
            history = torch.zeros(n, dtype=f32, device=device)
            self.register_buffer(f"fp8_amax_history_{op.value}", history)
            self.register_buffer(f"fp8_scale_{op.value}", torch.ones((), dtype=f32, device=device))
            # 1 / scale, kept with it (not saved: remade from the scale at load)
            inverse = torch.ones((), dtype=f32, device=device)
            self.register_buffer(f"fp8_inverse_{op.value}", inverse, persistent=False)
            init = torch.zeros((), dtype=torch.bool, device=device)
            self.register_buffer(f"fp8_initialized_{op.value}", init)
            nonfinite = torch.zeros((), dtype=f32, device=device)  # not saved: a diagnostic
            self.register_buffer(f"fp8_nonfinite_{op.value}", nonfinite, persistent=False)
        forwards = torch.zeros((), dtype=f32, device=device)
        self.register_buffer("fp8_forwards", forwards, persistent=False)
        self.weight_ready = False  # host mirror of fp8_initialized_weight (no device read)
        # operands whose `fp8_initialized_<op>` the host has read True (after a sync, from a
        # non-blocking copy: `fsdp_float8.fsdp.refresh`); `epoch` counts resets and loads,
        # so a read that a reset overtook is dropped
        self.ready_ops: frozenset[Operand] = frozenset()
        self.epoch = 0
        # each scale buffer's version when the host last knew it (a sync, a load, a
        # reset): a write outside those (an in-place checkpoint load) drops `ready`
        self.scale_versions: dict[Operand, int] = {}
        self._note_scales()
        self.syncs = 0  # how many syncs so far
        self.sync_group = None  # an explicit reduction group, remembered from a sync call
        self.register_load_state_dict_post_hook(_refresh_host_flags)
        self.register_state_dict_post_hook(_buffers_handed_out)

    @classmethod
    def for_config(cls, config: Float8LinearConfig, device=None) -> DelayedScalingState | None:
        """The state a layer with this config needs; None when no operand is delayed."""
        state = cls(config, device)
        return state if state.operands else None

    def view(self, op: Operand) -> DelayedState:
        amax, history, scale, initialized = (getattr(self, f"fp8_{k}_{op.value}") for k in _KINDS)
        nonfinite = getattr(self, f"fp8_nonfinite_{op.value}")
        inverse = getattr(self, f"fp8_inverse_{op.value}")
        ready = op in self.ready_ops
        return DelayedState(amax, history, scale, initialized, nonfinite, ready, inverse)

    @property
    def ready(self) -> bool:
        """Every delayed operand has a synced scale (reads the device: for tests and logs)."""
        return all(bool(self.view(op).initialized) for op in self.operands)

    # -- the casts ------------------------------------------------------------------------
    def views(self, training: bool, count_in_input: bool = False) -> dict[Operand, DelayedState]:
        """The per-operand states a forward casts with. Outside training the casts use the
        delayed scales but record into scratch amaxes, so evaluation never feeds the
        history. A training forward is counted on the device (no host state to guard on
        under torch.compile; an activation-checkpoint recompute only re-records the same
        amaxes, which a max leaves unchanged); with `count_in_input` (the forward casts
        and records its input) by the input's record, else here. Eager, a scale written in place since the host
        last knew it (`drop_if_scales_written`) is seen here too, so a forward that no
        refresh precedes (evaluation, the float8 step off) casts with it and its inverse."""
        if not torch.compiler.is_compiling():
            self.drop_if_scales_written()
        states = {op: self.view(op) for op in self.operands}
        if not training:
            return {
                op: s._replace(amax=torch.zeros_like(s.amax), nonfinite=None)
                for op, s in states.items()
            }
        if count_in_input and Operand.INPUT in states:  # the forward records its input
            states[Operand.INPUT] = states[Operand.INPUT]._replace(forwards=self.fp8_forwards)
        else:
            self.fp8_forwards.add_(1)
        return states

    def scratch(self, op: Operand) -> DelayedState | None:
        """A copy of one operand's state (None if it is not delayed): a cast computed with
        it gives exactly the layer's scale and records into the copy only."""
        if op not in self.operands:
            return None
        state = self.view(op)
        nonfinite = None if state.nonfinite is None else state.nonfinite.clone()
        amax, history, scale, initialized = (
            t.clone() for t in (state.amax, state.amax_history, state.scale, state.initialized)
        )
        inverse = None if state.inverse is None else state.inverse.clone()
        return DelayedState(amax, history, scale, initialized, nonfinite, state.ready, inverse)

    def weight_scale(self, shard: torch.Tensor, mesh: Group) -> torch.Tensor:
        """The scale source of a delayed float8-gathered weight: records the local shard's
        amax, returns the synced weight scale. Not seeded yet (no sync before the first
        forward): the shard amaxes are all-reduced once so every rank casts alike."""
        state = self.view(Operand.WEIGHT)
        amax = tensor_amax(shard)
        state.record(amax)
        if self.weight_ready:
            return state.scale.clone()
        strategy, dtype = self.strategies[Operand.WEIGHT], self.dtypes[Operand.WEIGHT]
        return strategy.scale_from_amax(amax, dtype, group=mesh)

    # -- the sync ---------------------------------------------------------------------------
    @property
    def unseeded(self) -> bool:
        """Host-side: a delayed weight whose scale was never seeded nor synced."""
        return Operand.WEIGHT in self.operands and not self.weight_ready

    def slots(self, local_weight: torch.Tensor) -> dict[Operand | str, torch.Tensor]:
        """This layer's share of the sync vector: each operand's recorded amax and whether
        it ran (`fp8_forwards > 0`). An unseeded weight's amax is recorded from
        `local_weight` (the high-precision local shard) first."""
        if Operand.WEIGHT in self.operands and not self.weight_ready:
            # a forward that ran recorded the weight it cast; the weight as it is now (after
            # the optimizer step) is the next step's, as in a run seeded before its forward
            amax = tensor_amax(local_weight)
            ran = self.fp8_forwards > 0
            self.view(Operand.WEIGHT).record(torch.where(ran, torch.zeros_like(amax), amax))
        out: dict[Operand | str, torch.Tensor] = {op: self.view(op).amax for op in self.operands}
        out["ran"] = (self.fp8_forwards > 0).to(torch.float32)
        return out

    def apply_reduced(self, amaxes: dict[Operand, torch.Tensor], ran_everywhere: torch.Tensor):
        """Roll each operand's history with its cross-rank reduced amax where the layer ran
        on every rank (decided on the device: no host sync); an unseeded weight is seeded.
        "No amax" never becomes a scale."""
        seed = Operand.WEIGHT in self.operands and not self.weight_ready
        for op, amax in amaxes.items():
            apply = ran_everywhere | seed if op is Operand.WEIGHT else ran_everywhere
            self.view(op).roll(amax, self.strategies[op], self.dtypes[op], where=apply)
        self.fp8_forwards.zero_()
        self.weight_ready = Operand.WEIGHT in self.operands
        self.syncs += 1
        self._note_scales()

    def _note_scales(self) -> None:
        self.scale_versions = {op: self.view(op).scale._version for op in self.operands}

    def drop_if_scales_written(self) -> bool:
        """Host-side, before a refresh or a forward: a scale buffer written since the host
        last knew it (not by a sync, a load or a reset: an in-place checkpoint load such as
        `dcp.load(model.state_dict())`) may come with an unsynced `initialized` flag and no
        longer matches its inverse. Then nothing is `ready` until a sync says so again, and
        each inverse is made anew from its scale. True when that happened."""
        versions = self.scale_versions
        if all(getattr(self, f"fp8_scale_{op.value}")._version == v for op, v in versions.items()):
            return False
        self.forget_ready()
        self.remake_inverses()
        return True

    @torch.no_grad()
    def remake_inverses(self) -> None:
        """Each inverse made anew from its scale (a load, a written scale), and the scales'
        versions noted as the host's."""
        for op in self.operands:
            view = self.view(op)
            if view.inverse is not None:
                view.inverse.copy_(view.scale.reciprocal())
        self._note_scales()

    def forget_ready(self) -> None:
        """Nothing is taken as synced until a sync (or a load) says so again; a host read of
        the flags queued before now is dropped when it lands (`mark_ready`)."""
        self.ready_ops = frozenset()
        self.epoch += 1

    def unready(self) -> list[Operand]:
        """The delayed operands whose synced scale the host has not seen yet."""
        return [op for op in self.operands if op not in self.ready_ops]

    def mark_ready(self, ops: list[Operand], flags: list[bool], epoch: int) -> None:
        """The host read of `fp8_initialized_<op>` for `ops` (made at `epoch`): each True
        one is ready from now on (a compiled forward recompiles once for it)."""
        if epoch == self.epoch:
            self.ready_ops |= {op for op, flag in zip(ops, flags, strict=True) if flag}

    def use_group(self, group) -> None:
        """Reduce over `group` from now on (instead of the weight's FSDP2 mesh)."""
        self.sync_group = group

    @torch.no_grad()
    def reset(self) -> None:
        """Back to the initial values: no history, unseeded."""
        for op in self.operands:
            state = self.view(op)
            state.amax.zero_()
            state.amax_history.zero_()
            state.scale.fill_(1.0)
            if state.inverse is not None:
                state.inverse.fill_(1.0)
            state.initialized.fill_(False)
            if state.nonfinite is not None:
                state.nonfinite.zero_()
        self.fp8_forwards.zero_()
        self.weight_ready = False
        self.forget_ready()
        self._note_scales()

    def __setstate__(self, state) -> None:
        # a copy (copy.deepcopy, unpickling) holds new buffers, whose version counters are
        # their own: its host flags are read from them, as a load does
        super().__setstate__(state)
        if not any(b.is_meta for b in self._buffers.values() if b is not None):
            _refresh_host_flags(self, None)

    def _apply(self, fn, recurse=True):
        # dtype-stable: take the device move from fn, keep the float32 values (a round trip
        # through bf16 would round the amaxes and scales)
        saved = dict(self._buffers)
        out = super()._apply(fn, recurse)
        for name, old in saved.items():
            new = self._buffers[name]
            if new is not None and old is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        if any(old is not None and old.is_meta for old in saved.values()) and not any(
            b.is_meta for b in self._buffers.values() if b is not None
        ):
            self.reset()  # to_empty() after meta init: fresh, not garbage
        return out

    def extra_repr(self) -> str:
        return f"operands={[op.value for op in self.operands]}"


def _buffers_handed_out(state: DelayedScalingState, state_dict, prefix, metadata) -> None:
    # a state dict holds the buffers themselves, and whatever writes into them in place (an
    # in-place checkpoint load, an EMA update) runs no hook: eager forwards and the float8
    # step see the scales' versions move, a compiled forward runs no host code first. So
    # the scales count as unsynced until the next sync says otherwise: a compiled cast then
    # takes the scale the device holds, with its inverse made in the graph (a recompile
    # the first time; the same numbers, one small amax pass more per cast until then)
    if state.ready_ops:
        state.forget_ready()


def _refresh_host_flags(state: DelayedScalingState, incompatible_keys) -> None:
    # one host read at load time, so no forward and no all-gather hook reads a device flag
    flags = {op: bool(state.view(op).initialized) for op in state.operands}
    state.weight_ready = flags.get(Operand.WEIGHT, False)
    state.epoch += 1
    state.ready_ops = frozenset(op for op, flag in flags.items() if flag)
    state.remake_inverses()


def nonfinite_amaxes(model: nn.Module) -> dict[str, int]:
    """How many non-finite amaxes each delayed operand left out of its history since the
    model was built (or `reset`), as {"<layer fqn>.<operand>": count}, nonzero counts only.
    A nonzero count means a forward or backward saw inf/NaN in that operand; the history and
    scale carry on from the finite amaxes. Reads the device: call it for logs, not per step."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, DelayedScalingState):
            layer = name.removesuffix("delayed_scaling").rstrip(".")
            for op in module.operands:
                count = int(getattr(module, f"fp8_nonfinite_{op.value}").item())
                if count:
                    out[f"{layer}.{op.value}" if layer else op.value] = count
    return out


_STATE_KEY = re.compile(r"(^|\.)delayed_scaling\.fp8_\w+$")


def export_state_dict(model: nn.Module, state_dict: dict | None = None) -> dict:
    """The weights of a converted model as the unconverted model holds them: its
    `state_dict()` (or the given one, e.g. a full state dict from
    `torch.distributed.checkpoint.state_dict.get_model_state_dict`) without the
    delayed-scaling buffers (amax histories, scales), so it loads with `strict=True` into the
    original `nn.Module`. Training checkpoints keep those buffers: resuming needs them.

    The same dict loads a checkpoint saved without delayed-scaling state into a
    delayed-scaling model in place (DCP would report the missing `fp8_amax_*` keys):
    `dcp.load(export_state_dict(model), checkpoint_id=...)`. A model that has not synced yet
    then starts its histories afresh; a synced one keeps its histories and scales, from
    weights that are no longer there, until later syncs roll them out (call
    `delayed_scaling.reset()` on each layer first to start afresh)."""
    state_dict = model.state_dict() if state_dict is None else state_dict
    return {k: v for k, v in state_dict.items() if not _STATE_KEY.search(k)}
