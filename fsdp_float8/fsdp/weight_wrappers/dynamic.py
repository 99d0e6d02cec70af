"""Dynamically scaled weight: the scale comes from the weight's current amax.

Preferred source: the scale stored by `precompute_float8_dynamic_scale_for_fsdp` after the
last optimizer step (one batched collective for the whole model). It is trusted only while
the weight is unchanged since (the mutation generation of `base.WeightState`, bumped by
every in-place op on the wrapper or its aliases), so a forgotten precompute costs a
collective, never a stale scale. Otherwise: the local shard's amax,
all-reduced over the shard mesh (one small collective for this weight).
Rowwise (axiswise) weights scale each output row by its own amax: local to the dim-0 shard,
so they need neither collective nor precompute (`mesh` is then None), except under
row-parallel tensor parallelism, whose TP shards split each row (`mesh`: the TP group).
"""

from __future__ import annotations

import torch

from fsdp_float8.core.scaling import amax_to_scale, axis_amax, tensor_amax
from fsdp_float8.fsdp.amax_sync import all_reduce_amax_
from fsdp_float8.fsdp.weight_wrappers.base import Float8WeightWrapper


class DynamicFloat8Weight(Float8WeightWrapper):
    def set_precomputed_scale(self, scale: torch.Tensor) -> None:
        self.stamp_scale(scale)

    def has_fresh_precomputed_scale(self) -> bool:
        """True while the scale stored by the last precompute matches the current values
        (host-side integer checks, no device sync)."""
        return self.fresh_stamped_scale() is not None

    def float8_scale(self, mesh) -> torch.Tensor:
        pow2 = self._config.round_scales_to_power_of_2
        if self.rowwise:  # per output row: no collective unless tensor parallel splits rows
            amax = all_reduce_amax_(axis_amax(self._tensor, -1), mesh)
            return amax_to_scale(amax, self.float8_dtype, power_of_2=pow2)
        precomputed = self.fresh_stamped_scale()
        if precomputed is not None:
            return precomputed
        amax = all_reduce_amax_(tensor_amax(self._tensor).reshape(1), mesh)[0]
        return amax_to_scale(amax, self.float8_dtype, power_of_2=pow2)
