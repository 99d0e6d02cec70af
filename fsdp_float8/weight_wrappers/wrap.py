"""Weight tensor subclasses whose FSDP2 all-gather sends float8 (see `base`).

`wrap_weight` is the one way a weight (a linear's, an expert projection's, a 4-bit
layer's) becomes a wrapper: for a `Float8LinearConfig` the type of the weight's scaling
strategy picks the class (`wrapper_class`), and a delayed weight gets its layer's
`DelayedScalingState` as its scale source; the config of a format with a layer of its own
(the 4-bit one) names its wrapper class itself (`weight_wrapper`), and so does a module
whose weights need another wrapper than its config's layer (the 4-bit experts).
"""

from __future__ import annotations

import weakref
from typing import cast

import torch
from torch import nn

from fsdp_float8.core.config import Float8LinearConfig
from fsdp_float8.core.gemms import Gemm, Operand
from fsdp_float8.core.scaling import (
    DelayedScaling,
    DynamicScaling,
    ScalingStrategy,
    StaticScaling,
)
from fsdp_float8.weight_wrappers.base import Float8WeightWrapper, plain_weight
from fsdp_float8.weight_wrappers.block import BlockFloat8Weight
from fsdp_float8.weight_wrappers.cast import LayerConfig
from fsdp_float8.weight_wrappers.delayed import DelayedFloat8Weight, ScaleSource
from fsdp_float8.weight_wrappers.dynamic import DynamicFloat8Weight
from fsdp_float8.weight_wrappers.static import StaticFloat8Weight


def wrapper_class(strategy: ScalingStrategy) -> type[Float8WeightWrapper]:
    """The wrapper whose all-gather casts as `strategy` says: its type picks where the scale
    comes from (block scales: from the shard's own blocks, no collective)."""
    if not strategy.granularity.broadcast_scales:
        return BlockFloat8Weight
    return _WRAPPERS[type(strategy)]


_WRAPPERS: dict[type, type[Float8WeightWrapper]] = {
    DynamicScaling: DynamicFloat8Weight,
    DelayedScaling: DelayedFloat8Weight,
    StaticScaling: StaticFloat8Weight,
}


def wrapper_class_of(
    config: LayerConfig, module: nn.Module | None = None
) -> type[Float8WeightWrapper]:
    """The wrapper of a weight built from `config`: the class the module names for its
    weights (`weight_wrapper`: a 4-bit experts module's 3-D weights), else by the weight
    strategy of a `Float8LinearConfig`, else the class the config names (`weight_wrapper`)."""
    named = getattr(type(module), "weight_wrapper", None) if module is not None else None
    if isinstance(named, type) and issubclass(named, Float8WeightWrapper):
        return named
    if isinstance(config, Float8LinearConfig):
        strategy = config.strategy(Operand.WEIGHT, Gemm.OUTPUT)
        assert strategy is not None  # the config refuses float8 all-gather of a hp weight
        return wrapper_class(strategy)
    own = getattr(type(config), "weight_wrapper", None)
    if not (isinstance(own, type) and issubclass(own, Float8WeightWrapper)):
        raise TypeError(
            f"cannot wrap a weight for a {type(config).__name__}: expected a "
            "Float8LinearConfig or a layer config that names its weight wrapper class "
            "(a Float8WeightWrapper subclass) as the class attribute weight_wrapper"
        )
    return own


def wrap_weight(weight: torch.Tensor, module: nn.Module, name: str = "weight") -> nn.Parameter:
    """The module's weight (a linear's, or one 3-D weight of float8 experts) as a Parameter
    whose FSDP2 all-gather is quantized as the module's config says (`wrapper_class_of`).
    The old Parameter is remembered as replaced (an optimizer that still holds it is
    refused)."""
    config = cast(LayerConfig, module.config)
    wrapper = wrapper_class_of(config, module)(weight.data, config)
    wrapper.param_name = name
    if isinstance(wrapper, DelayedFloat8Weight):
        wrapper.scale_source = cast(ScaleSource, module.delayed_scaling)
    if isinstance(weight, nn.Parameter):
        note_replaced(weight, f"{name} {tuple(weight.shape)} of a {type(module).__name__}")
    return nn.Parameter(wrapper, requires_grad=weight.requires_grad)


_REPLACED: dict[int, tuple[weakref.ref, str]] = {}  # id(old Parameter) -> (ref, where)


def note_replaced(old: torch.Tensor, where: str) -> None:
    """Remember that `old` (a Parameter) was replaced in its module; `where` names it."""
    key = id(old)
    _REPLACED[key] = (weakref.ref(old, lambda _: _REPLACED.pop(key, None)), where)


def replaced_parameter(p: torch.Tensor) -> str | None:
    """Where `p` was before conversion replaced it, or None (not a replaced Parameter)."""
    entry = _REPLACED.get(id(p))
    return entry[1] if entry is not None and entry[0]() is p else None


__all__ = [
    "Float8WeightWrapper",
    "BlockFloat8Weight",
    "DynamicFloat8Weight",
    "DelayedFloat8Weight",
    "StaticFloat8Weight",
    "note_replaced",
    "plain_weight",
    "replaced_parameter",
    "wrap_weight",
    "wrapper_class",
    "wrapper_class_of",
]
