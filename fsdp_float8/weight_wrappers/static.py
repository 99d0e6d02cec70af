"""Statically scaled weight: the user-given scale, no collective."""

from __future__ import annotations

import torch

from fsdp_float8.config import Gemm, Operand
from fsdp_float8.weight_wrappers.base import Float8WeightWrapper


class StaticFloat8Weight(Float8WeightWrapper):
    def float8_scale(self, mesh, module) -> torch.Tensor:
        value = self._config.cast(Operand.WEIGHT, Gemm.OUTPUT).static_scale
        return torch.tensor(value, dtype=torch.float32, device=self._tensor.device)
