"""Weights whose shard's all-gather cast needs the whole weight's amax: `RefreshedWeight`.

A tensor-wide factor (a dynamic tensorwise float8 scale, the 4-bit format's tensor factor)
must be the same on every rank, so it comes from the whole weight's amax: the MAX over the
ranks of each shard's amax. The float8 step reduces the amaxes of all such weights of a
model in one collective after each optimizer step (`fsdp_float8.fsdp.refresh`) and stamps
into each weight what its class derives from its reduced amax (`stamps_from_amaxes`, one
vector op per class and rule): a float8 scale with its inverse, or the amax itself. The
stamp is trusted while the weight is unchanged since (the mutation generation of
`state.WeightState`); without a fresh stamp the weight's all-gather all-reduces its own
shard's amax. What the refresh asks is this class and `needs_global_amax` (an instance of
a subclass whose format keeps its scales per row needs none), never a format's class.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from fsdp_float8.weight_wrappers.base import Float8WeightWrapper


class RefreshedWeight(Float8WeightWrapper):
    # the refresh also stamps the inverse of what it stamps (one vector op for all)
    STAMPS_INVERSE: ClassVar[bool] = False

    @staticmethod
    def stamps_from_amaxes(amaxes, float8_dtype, power_of_2) -> torch.Tensor:
        """What the refresh stamps for weights of this class, from their reduced amaxes
        (one vector op per class and rule; the cast's float8 dtype and power-of-two rule)."""
        raise NotImplementedError

    def set_precomputed_scale(
        self, scale: torch.Tensor, scales: torch.Tensor | None = None
    ) -> None:
        """Store the next all-gather's stamp; `scales`: (scale, 1 / scale) as one 2-element
        tensor whose [0] is `scale` (the refresh computes all inverses in one op)."""
        self._state.stamp_scale(scale, scales)

    def needs_refresh(self) -> bool:
        return self._cast.needs_global_amax and self._state.fresh_scale() is None

    def has_fresh_precomputed_scale(self) -> bool:
        """True while the stamp of the last refresh matches the current values (host-side
        integer checks, no device sync)."""
        return self._state.fresh_scale() is not None
