"""Weight tensor subclasses whose FSDP2 all-gather sends float8 (see `base`)."""

from __future__ import annotations

from torch import nn

from fsdp_float8.config import Float8LinearConfig, Gemm, Operand, ScalingType
from fsdp_float8.weight_wrappers.base import Float8WeightWrapper
from fsdp_float8.weight_wrappers.delayed import DelayedFloat8Weight
from fsdp_float8.weight_wrappers.dynamic import DynamicFloat8Weight
from fsdp_float8.weight_wrappers.static import StaticFloat8Weight

WRAPPER_FOR_SCALING = {
    ScalingType.DYNAMIC: DynamicFloat8Weight,
    ScalingType.DELAYED: DelayedFloat8Weight,
    ScalingType.STATIC: StaticFloat8Weight,
}


def wrap_weight(weight: nn.Parameter, module: nn.Module) -> nn.Parameter:
    """The module's weight as a Parameter whose FSDP2 all-gather is float8."""
    config: Float8LinearConfig = module.config
    scaling_type = config.cast(Operand.WEIGHT, Gemm.OUTPUT).scaling_type
    cls = WRAPPER_FOR_SCALING[scaling_type]
    return nn.Parameter(cls(weight.data, config), requires_grad=weight.requires_grad)


__all__ = [
    "Float8WeightWrapper",
    "DynamicFloat8Weight",
    "DelayedFloat8Weight",
    "StaticFloat8Weight",
    "wrap_weight",
]
