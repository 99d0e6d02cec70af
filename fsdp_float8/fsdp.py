"""Whole-model passes for FSDP2 training, each with one collective.

- `precompute_float8_dynamic_scale_for_fsdp(model)`: after `optimizer.step()`, the amaxes
  of every dynamically scaled float8 weight shard in one batched pass (`tensor_amaxes`),
  one all-reduce(MAX), then each weight's scale is stored for its next all-gather.
- `sync_float8_amax_and_scale_history(model)`: for delayed scaling, every recorded amax of
  every operand of every layer in one all-reduce(MAX), then histories roll and scales
  update identically on every rank.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_float8.amax_sync import Group, reduce_amaxes
from fsdp_float8.config import PRIMARY_GEMM, Operand
from fsdp_float8.linear import Float8Linear
from fsdp_float8.scaling import DelayedScaling, amax_to_scale, tensor_amax, tensor_amaxes
from fsdp_float8.weight_wrappers import DynamicFloat8Weight, Float8WeightWrapper


def _float8_linears(model: nn.Module) -> list[Float8Linear]:
    return [m for m in model.modules() if isinstance(m, Float8Linear)]


def _mesh_of(model: nn.Module):
    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh
    return None


@torch.no_grad()
def precompute_float8_dynamic_scale_for_fsdp(model: nn.Module) -> int:
    """Store the next all-gather's scale on every dynamic float8 weight; returns how many.
    Call it after each `optimizer.step()` (and once before the first forward)."""
    by_mesh: dict[object, list[tuple[DynamicFloat8Weight, Float8Linear]]] = {}
    for m in _float8_linears(model):
        w = m.weight
        local = w._local_tensor if isinstance(w, DTensor) else w
        if isinstance(local, DynamicFloat8Weight) and not local.rowwise:
            mesh = w.device_mesh if isinstance(w, DTensor) else None
            by_mesh.setdefault(mesh, []).append((local, m))
    for mesh, items in by_mesh.items():
        # an empty shard (fewer rows than ranks) contributes amax 0
        amaxes = reduce_amaxes(tensor_amaxes([w._tensor for w, _ in items]), mesh)
        for (w, m), amax in zip(items, amaxes.unbind(), strict=True):
            pow2 = m.config.round_scales_to_power_of_2
            w.set_precomputed_scale(amax_to_scale(amax, w.float8_dtype, power_of_2=pow2))
    return sum(len(v) for v in by_mesh.values())


@torch.no_grad()
def sync_float8_amax_and_scale_history(model: nn.Module, *, group: Group = None) -> int:
    """Reduce all delayed amaxes across data-parallel ranks in one collective, roll the
    histories, update the scales. `group` defaults to the mesh of the model's FSDP2
    parameters (none: a single process). Returns the number of operands updated.

    Called once before the first forward, it seeds every delayed weight's scale from the
    weight itself (the same single collective), so the first step needs no per-weight
    amax all-reduce; inputs and grad_outputs have no amax yet and are left alone."""
    group = group if group is not None else _mesh_of(model)
    entries = []
    for m in _float8_linears(model):
        # only layers that ran a training forward since the last sync have amaxes to
        # reduce: "no amax" must never become a scale. Every rank runs the same layers, so
        # every rank reduces the same vector.
        if m.forwards_since_sync > 0:
            entries += [(m, op, m.delayed_state(op)) for op in m.delayed_operands()]
        elif Operand.WEIGHT in m.delayed_operands() and not m.delayed_weight_ready:
            state = m.delayed_state(Operand.WEIGHT)
            DelayedScaling.record(state, tensor_amax(_local_hp_weight(m.weight)))
            entries.append((m, Operand.WEIGHT, state))
    if not entries:
        return 0
    reduced = reduce_amaxes([s.amax for _, _, s in entries], group)
    for (m, op, state), amax in zip(entries, reduced.unbind(), strict=True):
        state.amax.copy_(amax)
        key = (op, PRIMARY_GEMM[op])
        m.plan.strategies[key].update(state, m.config.float8_dtype(*key))
    for m, _, _ in entries:
        if m.forwards_since_sync > 0:
            m.mark_delayed_synced()
        else:
            m.delayed_weight_ready = True
    return len(entries)


def _local_hp_weight(weight: torch.Tensor) -> torch.Tensor:
    local = weight._local_tensor if isinstance(weight, DTensor) else weight
    return local._tensor if isinstance(local, Float8WeightWrapper) else local
