"""Statically scaled weight: the user-given scale (one cached device tensor), no collective."""

from __future__ import annotations

import torch

from fsdp_float8.core.scaling import static_scale_tensor
from fsdp_float8.weight_wrappers.base import Float8WeightWrapper


class StaticFloat8Weight(Float8WeightWrapper):
    def float8_scale(self, mesh) -> torch.Tensor:
        value = self._cast.static_scale
        assert value is not None  # a static CastConfig has one
        return static_scale_tensor(value, self._tensor.device)
