"""Delayed-scaled weight: the scale is the module's current delayed weight scale.

The local shard's amax is recorded into the module's `fp8_amax_weight` buffer; the next
`sync_float8_amax_and_scale_history` reduces it with every other amax of the model in one
collective. A sync before the first forward seeds the weight's scale (in that one
collective); without it, the first step all-reduces each weight's shard amax once so every
rank casts with the same scale.
"""

from __future__ import annotations

import torch

from fsdp_float8.amax_sync import all_reduce_amax_
from fsdp_float8.config import Operand
from fsdp_float8.scaling import DelayedScaling, amax_to_scale, tensor_amax
from fsdp_float8.weight_wrappers.base import Float8WeightWrapper


class DelayedFloat8Weight(Float8WeightWrapper):
    def float8_scale(self, mesh, module) -> torch.Tensor:
        state = module.delayed_state(Operand.WEIGHT)
        amax = tensor_amax(self._tensor)
        DelayedScaling.record(state, amax)
        if module.delayed_weight_ready:
            return state.scale.clone()
        amax = all_reduce_amax_(amax.reshape(1), mesh)[0]
        return amax_to_scale(
            amax, self.float8_dtype, power_of_2=self._config.round_scales_to_power_of_2
        )
