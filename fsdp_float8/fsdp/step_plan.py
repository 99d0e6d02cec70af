"""What a float8 step does, described: the answer of `Float8Step.describe()`.

Mental model: a `StepPlan` is a read-only summary made from the step's units (a float8
layer or experts module with its weights and delayed state) as the model is now: which
layers are float8, which weights get a precomputed all-gather scale, which layers sync
delayed state, and how many refresh collectives a steady training step costs: one per
reduction group of more than one rank that holds work. A weight's group is its FSDP2 mesh,
so in a run of several ranks the count is unknown until `fully_shard` (None).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from fsdp_float8.core.amax_sync import Group, group_of
from fsdp_float8.fsdp import refresh
from fsdp_float8.fsdp.refresh import Unit, grouped_units


@dataclass(frozen=True)
class StepPlan:
    """What the float8 step of a model does (`Float8Step.describe()`)."""

    enabled: bool
    float8_layers: tuple[str, ...]  # float8 linear layers and experts modules
    precomputed_weights: tuple[str, ...]  # weights whose all-gather scale is precomputed
    delayed_layers: tuple[str, ...]  # layers whose delayed-scaling state is synced
    # refresh collectives per steady training step; None before `fully_shard` in a
    # distributed run (float8-gathered weights not sharded yet: their groups are unknown)
    collectives_per_step: int | None

    def __str__(self) -> str:
        state = "on" if self.enabled else "off (explicit calls only)"
        n = self.collectives_per_step
        count = (
            f"{n} collective(s) per optimizer step"
            if n is not None
            else "collectives per optimizer step known after fully_shard (no weight is sharded yet)"
        )
        return (
            f"float8 step {state}: {len(self.float8_layers)} float8 layers, "
            f"{len(self.precomputed_weights)} precomputed weight scales, "
            f"{len(self.delayed_layers)} delayed-scaling layers; {count}"
        )


def plan_of(units: list[tuple[Unit, Group]], *, enabled: bool) -> StepPlan:
    """The plan of a step over `units` (each with its default reduction group)."""
    grouped = grouped_units(units)
    layers = dict.fromkeys(u.layer for u, _ in units if u.float8)
    delayed = dict.fromkeys(u.layer for u, _ in units if u.delayed() is not None)
    return StepPlan(
        enabled=enabled,
        float8_layers=tuple(layers),
        precomputed_weights=tuple(u.fqn for u, _ in units if u.dynamic_weight() is not None),
        delayed_layers=tuple(delayed),
        collectives_per_step=None if _awaits_sharding(grouped) else refresh.collectives(grouped),
    )


def _awaits_sharding(grouped: dict[Group, list[Unit]]) -> bool:
    """Several ranks, and float8-gathered weights in no reduction group yet (not sharded)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    return any(
        group_of(g) is None and any(u.dynamic_weight() is not None for u in us)
        for g, us in grouped.items()
    )
