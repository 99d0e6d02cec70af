"""Delayed-scaled weight: the scale comes from a scale source, its layer's delayed state.

`scale_source` is the layer's `DelayedScalingState` (set by `wrap_weight`): it records the
local shard's amax for the next sync and returns the synced weight scale, or, before the
weight was ever seeded, all-reduces the shard amax once so every rank casts alike. The
wrapper never sees the module.
"""

from __future__ import annotations

from typing import Protocol

import torch

from fsdp_float8.weight_wrappers.base import Float8WeightWrapper


class ScaleSource(Protocol):
    """What a delayed weight asks its layer's delayed state (`DelayedScalingState`)."""

    @property
    def unseeded(self) -> bool: ...

    def weight_scale(self, shard: torch.Tensor, mesh) -> torch.Tensor: ...


class DelayedFloat8Weight(Float8WeightWrapper):
    scale_source: ScaleSource | None = None

    def _copy_state_to(self, new) -> None:
        new.scale_source = self.scale_source

    def needs_refresh(self) -> bool:
        return self.scale_source is not None and self.scale_source.unseeded

    def float8_scale(self, mesh) -> torch.Tensor:
        if self.scale_source is None:
            raise ValueError(
                "DelayedFloat8Weight has no scale source (its layer's delayed state); build "
                "float8 all-gather weights with convert_to_float8_training or "
                "fsdp_float8.weight_wrappers.wrap.wrap_weight(weight, layer)"
            )
        return self.scale_source.weight_scale(self._tensor, mesh)
