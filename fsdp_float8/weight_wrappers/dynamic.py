"""Dynamically scaled weight: the scale comes from the weight's current amax.

Preferred source: the scale stored by `precompute_float8_dynamic_scale_for_fsdp` after the
last optimizer step (one batched collective for the whole model). It is trusted only while
the weight is unchanged since (the mutation generation of `state.WeightState`, bumped by
every in-place op on the wrapper or its aliases), so a forgotten precompute costs a
collective, never a stale scale. Otherwise: the local shard's amax,
all-reduced over the shard mesh (one small collective for this weight).
Rowwise (axiswise) weights scale each output row by its own amax: local to the dim-0 shard,
so they need neither collective nor precompute (`mesh` is then None), except under
row-parallel tensor parallelism, whose TP shards split each row (`mesh`: the TP group).
"""

from __future__ import annotations

import torch

from fsdp_float8.core.scaling import DynamicScaling, scale_from_amax
from fsdp_float8.weight_wrappers.base import Float8WeightWrapper


class DynamicFloat8Weight(Float8WeightWrapper):
    STAMPS_INVERSE = True  # the refresh also stamps 1 / scale (one vector op for all)

    @staticmethod
    def stamps_from_amaxes(amaxes, float8_dtype, power_of_2) -> torch.Tensor:
        """What the refresh stamps for weights of this class, from their reduced amaxes
        (one vector op per class and rule): their precomputed scales."""
        return scale_from_amax(amaxes, float8_dtype, power_of_2=power_of_2)

    def set_precomputed_scale(
        self, scale: torch.Tensor, scales: torch.Tensor | None = None
    ) -> None:
        """Store the next all-gather's scale; `scales`: (scale, 1 / scale) as one 2-element
        tensor whose [0] is `scale` (the refresh computes all inverses in one op)."""
        self._state.stamp_scale(scale, scales)

    def needs_refresh(self) -> bool:
        return self._cast.needs_global_amax and self._state.fresh_scale() is None

    def has_fresh_precomputed_scale(self) -> bool:
        """True while the scale stored by the last precompute matches the current values
        (host-side integer checks, no device sync)."""
        return self._state.fresh_scale() is not None

    def float8_scale(self, mesh) -> torch.Tensor:
        if self._cast.needs_global_amax:
            precomputed = self._state.fresh_scale()
            if precomputed is not None:
                return precomputed
        # the shard's amax MAX-reduced over `mesh`: the shard mesh (tensorwise); rowwise,
        # only tensor parallel's dim that splits rows, else None (no collective)
        strategy = self.strategy
        assert isinstance(strategy, DynamicScaling)  # `wrapper_class` picked this class by it
        amax = strategy.granularity.amax(self._tensor, self.ROW_SCALE_DIM)
        return strategy.scale_from_amax(amax, self.float8_dtype, mesh)
