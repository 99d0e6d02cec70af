"""Dynamically scaled weight: the scale comes from the weight's current amax.

Preferred source: the scale stored by `precompute_float8_dynamic_scale_for_fsdp` after the
last optimizer step (one batched collective for the whole model, `refreshed`). It is
trusted only while the weight is unchanged since (the mutation generation of
`state.WeightState`, bumped by every in-place op on the wrapper or its aliases), so a
forgotten precompute costs a collective, never a stale scale. Otherwise: the local shard's
amax, all-reduced over the shard mesh (one small collective for this weight).
Rowwise (axiswise) weights scale each output row by its own amax: local to the dim-0 shard,
so they need neither collective nor precompute (`mesh` is then None), except under
row-parallel tensor parallelism, whose TP shards split each row (`mesh`: the TP group).
"""

from __future__ import annotations

import torch

from fsdp_float8.core.scaling import DynamicScaling, scale_from_amax
from fsdp_float8.weight_wrappers.refreshed import RefreshedWeight


class DynamicFloat8Weight(RefreshedWeight):
    STAMPS_INVERSE = True  # the GEMMs multiply by 1 / scale: stamped with the scale

    @staticmethod
    def stamps_from_amaxes(amaxes, float8_dtype, power_of_2) -> torch.Tensor:
        """The precomputed float8 scales of weights of this class, from their amaxes."""
        return scale_from_amax(amaxes, float8_dtype, power_of_2=power_of_2)

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
