"""Weight tensor subclasses whose FSDP2 all-gather sends float8 (see `base`).

`wrap_weight` is the one way a layer's weight becomes a wrapper: the config picks the class
(`Float8LinearConfig.weight_wrapper_class`), and a delayed weight gets its layer's
`DelayedScalingState` as its scale source.
"""

from __future__ import annotations

from torch import nn

from fsdp_float8.fsdp.weight_wrappers.base import Float8WeightWrapper, plain_weight
from fsdp_float8.fsdp.weight_wrappers.block import BlockFloat8Weight
from fsdp_float8.fsdp.weight_wrappers.delayed import DelayedFloat8Weight
from fsdp_float8.fsdp.weight_wrappers.dynamic import DynamicFloat8Weight
from fsdp_float8.fsdp.weight_wrappers.static import StaticFloat8Weight


def wrap_weight(weight: nn.Parameter, module: nn.Module) -> nn.Parameter:
    """The module's weight as a Parameter whose FSDP2 all-gather is float8."""
    wrapper = module.config.weight_wrapper_class()(weight.data, module.config)
    if isinstance(wrapper, DelayedFloat8Weight):
        wrapper.scale_source = module.delayed_scaling
    return nn.Parameter(wrapper, requires_grad=weight.requires_grad)


__all__ = [
    "Float8WeightWrapper",
    "BlockFloat8Weight",
    "DynamicFloat8Weight",
    "DelayedFloat8Weight",
    "StaticFloat8Weight",
    "plain_weight",
    "wrap_weight",
]
