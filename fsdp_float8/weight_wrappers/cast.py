"""A weight's all-gather cast, resolved once from its config: `WeightCast`.

A weight wrapper is built from its layer's config (a `Float8LinearConfig`, or the config
of a format with a layer of its own, the 4-bit one), but its all-gather hooks run every
step: they read this frozen record (the weight's scaling strategy, float8 dtype, whether
the scales are per row, whether its shard's scale needs the whole weight's amax, its
format's place, emulation, a static scale) and never look anything up in the config.
The config stays in the record only as the wrapper's serialized form (pickling,
`__tensor_flatten__`), from which the record is resolved again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Protocol

import torch

from fsdp_float8.core.config import Float8LinearConfig
from fsdp_float8.core.families import Family
from fsdp_float8.core.gemms import Gemm, Operand
from fsdp_float8.core.scaling import DelayedScaling, DynamicScaling, ScalingStrategy
from fsdp_float8.formats.weight_operands import place_of


class LayerConfig(Protocol):
    """What every layer config a weight wrapper is built from has (`Float8LinearConfig`,
    the 4-bit layer's config): frozen, so a wrapper keeps it as its serialized form."""

    @property
    def enable_fsdp_float8_all_gather(self) -> bool: ...

    @property
    def emulate(self) -> bool: ...


@dataclass(frozen=True, eq=False)
class WeightCast:
    config: LayerConfig  # the serialized form; the hooks read the fields below
    # the float8 cast's scaling strategy; None for a format whose wrapper quantizes the
    # shard by its own rules (the 4-bit one): the float8 readers assert it
    # (`Float8WeightWrapper.strategy`)
    strategy: ScalingStrategy | None
    float8_dtype: torch.dtype
    family: Family  # its format family: what the float8 step and the hooks ask
    power_of_2: bool  # scales rounded down to a power of two (the strategy's rule)
    emulate: bool
    static_scale: float | None
    # the family's answers, read by the hooks every step: plain fields, no lookup per read
    per_row: bool = field(init=False)  # per-output-row scales: local to each dim-0 shard
    needs_global_amax: bool = field(init=False)  # the shard's scale: the whole weight's amax

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_row", self.family.per_row)
        object.__setattr__(self, "needs_global_amax", self.family.needs_global_amax)

    @classmethod
    def of(cls, config: LayerConfig) -> WeightCast:
        """The float8 all-gather cast of a `Float8LinearConfig`'s weight."""
        if not isinstance(config, Float8LinearConfig):
            raise TypeError(
                f"a float8 weight wrapper is built from a Float8LinearConfig, got "
                f"{type(config).__name__}; build the weight of another format's layer with "
                "fsdp_float8.weight_wrappers.wrap.wrap_weight(weight, layer)"
            )
        cast = config.cast(Operand.WEIGHT, Gemm.OUTPUT)
        strategy = config.strategy(Operand.WEIGHT, Gemm.OUTPUT)
        if strategy is None:
            raise ValueError(
                "a float8 all-gather weight needs a float8 weight cast, got "
                f"scaling_type={cast.scaling_type.value} for the weight; enable the weight "
                "cast or set enable_fsdp_float8_all_gather=False"
            )
        return cls(
            config=config,
            strategy=strategy,
            float8_dtype=config.float8_dtype(Operand.WEIGHT, Gemm.OUTPUT),
            family=cast.scaling_granularity.family,
            power_of_2=isinstance(strategy, DynamicScaling | DelayedScaling)
            and strategy.power_of_2,
            emulate=config.emulate,
            static_scale=cast.static_scale,
        )

    @property
    def place(self) -> ModuleType:
        """The format's place: how a shard is packed (`weight_wrappers.base`)."""
        return place_of(self.family)
