"""The float8 step of a model split in parts: pipeline stages, or torchtitan's
`model_parts` (one per stage this rank holds).

Mental model. `float8_step(model)` refreshes one module tree after each optimizer step of
any torch.optim optimizer holding its parameters. Under pipeline parallelism each stage is
its own tree with its own optimizer (torchtitan's `OptimizersContainer` holds one per part),
so each part gets its own step: its precomputed weight scales and delayed-scaling state are
refreshed after its own optimizer step, in one collective on its own data-parallel group.
A part holding no float8 layer (a stage left in high precision) gets none. Frameworks call
this once the optimizers are built; it needs torch only.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from fsdp_float8.fsdp.refresh import units_of
from fsdp_float8.fsdp.step import Float8Step, float8_step


def enable_float8_steps(model_parts: nn.Module | Iterable[nn.Module]) -> list[Float8Step]:
    """Turn the float8 step on for every part that holds float8 linear layers or float8
    experts (idempotent) and return those steps, in the parts' order. A single module is
    taken as one part."""
    parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)
    for i, part in enumerate(parts):
        if not isinstance(part, nn.Module):
            raise TypeError(
                f"model_parts[{i}] is a {type(part).__name__}; expected an nn.Module per "
                "pipeline stage (torchtitan passes its list of model parts)"
            )
    return [float8_step(p) for p in parts if any(u.float8 for u in units_of(p))]
