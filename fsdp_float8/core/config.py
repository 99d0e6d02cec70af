"""Configuration: which operand of which GEMM is cast how, and the named recipes.

A linear layer runs three GEMMs on three operands (`fsdp_float8.core.gemms`). Each
operand is cast once for its primary GEMM and possibly differently for its second use in
backward (`*_for_grad_*` fields). A `CastConfig` says how one such cast is scaled; this
module is the one place where those user-facing words become the strategy objects of
`fsdp_float8.core.scaling` (`Float8LinearConfig.strategy`). The rules of one cast's block
fields and between casts are in `config_rules.py` (which asks the casts, not their words),
field type checks and the error class in `config_fields.py`, the named recipes in
`recipes.py`.

Field names follow the ones torchao users know, so switching is a change of import; a
config built with torchao.float8 itself is converted field by field
(`as_float8_linear_config`). torchao's conventions (the cast fields' names, how an unset
cast is filled in, what a foreign config's fields are) are in `config_torchao.py`; this
module builds its classes from them.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch

from fsdp_float8.core import families, scaling
from fsdp_float8.core.config_fields import Float8ConfigError, check_field_types, coerce_enum
from fsdp_float8.core.config_rules import (
    check_block_cast,
    check_cast_pairs,
    check_delayed_scaling_config,
    check_gemm_configs,
    check_linear_blocks,
    check_no_e5m2_pair,
    check_share_input_casts,
    check_static_power_of_2,
    check_static_scale,
    warn_force_recompute,
)
from fsdp_float8.core.config_torchao import (
    CAST_FIELD,
    FOREIGN_GEMM_FIELDS,
    filled_casts,
    foreign_fields,
    foreign_linear_fields,
    type_name,
)
from fsdp_float8.core.gemms import OPERANDS, PRIMARY_GEMM, SECOND_GEMM, Gemm, Operand
from fsdp_float8.core.recipes import Float8LinearRecipeName, recipe_fields

E4M3 = torch.float8_e4m3fn
INPUT_GEMMS = (Gemm.OUTPUT, Gemm.GRAD_WEIGHT)
E5M2 = torch.float8_e5m2
FLOAT8_DTYPES = (E4M3, E5M2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


class ScalingType(enum.Enum):
    DYNAMIC = "dynamic"
    DELAYED = "delayed"
    STATIC = "static"
    DISABLED = "disabled"


class ScalingGranularity(enum.Enum):
    TENSORWISE = "tensorwise"
    AXISWISE = "axiswise"
    # one scale per block of CastConfig.block_shape = (across, along) the contraction dim
    BLOCKWISE = "blockwise"

    @property
    def family(self) -> families.Family:
        """The format family of casts with this granularity (`fsdp_float8.core.families`)."""
        return families.of_granularity(self.value)


@dataclass(frozen=True)
class CastConfig:
    """How one operand is cast for one GEMM. `target_dtype=None` means the operand's
    default (e4m3 for input and weight, e5m2 for grad_output); a `Float8LinearConfig` fills
    it in. Positional fields in torchao's order; the rest keyword-only.

    Blockwise casts (dynamic only) take `block_shape=(across, along)` the contraction dim,
    e.g. (1, 128), (128, 128), and `scale_dtype` float32 or `torch.float8_e8m0fnu` (MX;
    rules in `fsdp_float8.core.config_rules`, the math in `fsdp_float8.core.scaling.Blockwise`)."""

    scaling_type: ScalingType = ScalingType.DYNAMIC
    scaling_granularity: ScalingGranularity = ScalingGranularity.TENSORWISE
    target_dtype: torch.dtype | None = None
    _: KW_ONLY
    static_scale: float | None = None
    block_shape: tuple | None = None
    scale_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        check_field_types(self)
        coerce_enum(self, "scaling_type", ScalingType)
        coerce_enum(self, "scaling_granularity", ScalingGranularity)
        if self.target_dtype is not None and self.target_dtype not in FLOAT8_DTYPES:
            raise Float8ConfigError(
                f"CastConfig.target_dtype={self.target_dtype} is not a float8 dtype; "
                f"expected one of {FLOAT8_DTYPES} or None for the operand's default"
            )
        static = self.scaling_type is ScalingType.STATIC
        if static:
            dtypes = (self.target_dtype,) if self.target_dtype else (E4M3, E5M2)
            check_static_scale(self.static_scale, dtypes)
        if not static and self.static_scale is not None:
            raise Float8ConfigError(
                f"static_scale={self.static_scale} is only used with scaling_type=static, "
                f"got scaling_type={self.scaling_type.value}; drop static_scale or make it static"
            )
        tensorwise = self.scaling_granularity is ScalingGranularity.TENSORWISE
        if not tensorwise and self.keeps_scale:
            gran = self.scaling_granularity.value
            raise Float8ConfigError(
                f"{self.scaling_type.value} scaling is tensorwise only (one history or scale "
                f"per operand), got scaling_granularity={gran}; use dynamic {gran} scaling "
                "or tensorwise granularity"
            )
        check_block_cast(self)

    def granularity(self) -> scaling.Granularity:
        """The `fsdp_float8.core.scaling` granularity object this config names."""
        return _GRANULARITY[self.scaling_granularity](self)

    @property
    def enabled(self) -> bool:
        return self.scaling_type is not ScalingType.DISABLED

    @property
    def keeps_scale(self) -> bool:
        """Delayed and static scaling: one scale per operand, kept across steps."""
        return self.scaling_type in (ScalingType.DELAYED, ScalingType.STATIC)


_GRANULARITY: dict[ScalingGranularity, Callable[[CastConfig], scaling.Granularity]] = {
    ScalingGranularity.TENSORWISE: lambda cfg: scaling.Tensorwise(),
    ScalingGranularity.AXISWISE: lambda cfg: scaling.Axiswise(),
    ScalingGranularity.BLOCKWISE: lambda cfg: _blockwise(cfg),
}


def _blockwise(cfg: CastConfig) -> scaling.Blockwise:
    assert cfg.block_shape is not None  # check_block_cast required two ints
    across, along = cfg.block_shape
    return scaling.Blockwise(shape=(across, along), scale_dtype=cfg.scale_dtype)


@dataclass(frozen=True)
class DelayedScalingConfig:
    """Delayed scaling: the scale comes from a history of past amaxes.

    scale_fn_name: "max" (max over the history) or "most_recent".
    max_forwards_without_sync: a training forward that finds this many forwards since the
    last `sync_float8_amax_and_scale_history` raises, so a forgotten sync cannot go on
    silently with stale scales. Raise it for long gradient accumulation.
    """

    history_len: int = 16
    scale_fn_name: str = "max"
    _: KW_ONLY
    max_forwards_without_sync: int = 64

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.history_len < 1:
            raise Float8ConfigError(f"history_len must be an int >= 1, got {self.history_len!r}")
        if self.scale_fn_name not in ("max", "most_recent"):
            raise Float8ConfigError(
                f"scale_fn_name={self.scale_fn_name!r}; expected 'max' or 'most_recent'"
            )
        if self.max_forwards_without_sync < 1:
            raise Float8ConfigError(
                f"max_forwards_without_sync must be >= 1, got {self.max_forwards_without_sync}"
            )


@dataclass(frozen=True)
class Float8GemmConfig:
    use_fast_accum: bool = False

    def __post_init__(self) -> None:
        check_field_types(self)


@dataclass(frozen=True)
class Float8LinearConfig:
    """Everything a `Float8Linear` needs to know.

    Resolved at construction as torchao resolves it: a `*_for_grad_*` config left None is
    the operand's primary config, and a `target_dtype` left None the operand's default
    (e4m3 for input and weight, e5m2 for grad_output). The fields up to
    `round_scales_to_power_of_2` are positional in torchao's order; the rest keyword-only.
    `force_recompute_fp8_weight_in_bwd` is accepted for torchao compatibility and does
    nothing, as in torchao (a `FutureWarning` says so): eager backward re-casts the weight
    from the parameter (FSDP2 re-gathers it); compiled on a GPU, a dynamic tensorwise layer
    without float8 all-gather keeps the forward's float8 weight (`fsdp_float8.nn.linear`).

    `share_input_casts` (off by default): layers that read the same input tensor with the
    same dynamic casts (attention's wq/wk/wv, SwiGLU's w1/w3) share its float8 casts, one
    amax pass and one saved copy instead of one per layer (`fsdp_float8.core.input_casts`);
    input casts other than dynamic in both uses share nothing and are refused.
    The share is keyed by the input tensor and its version counter, so its contract is:
    between two readers of an input, nothing writes that input except in-place PyTorch ops
    on it or its views (they move the counter). Writes that leave the counter alone give
    the later readers the earlier cast, silently: in-place collectives (`dist.all_reduce(x)`),
    `x.data` writes or assignment, writes through `x.numpy()` or `torch.from_numpy`. Turn it
    on only where the readers' input is never written that way (a buffer refilled with
    `buf.data.copy_` between micro-batches breaks it too).
    """

    cast_config_input: CastConfig = field(default_factory=CastConfig)
    cast_config_input_for_grad_weight: CastConfig | None = None
    cast_config_weight: CastConfig = field(default_factory=CastConfig)
    cast_config_weight_for_grad_input: CastConfig | None = None
    cast_config_grad_output: CastConfig = field(default_factory=CastConfig)
    cast_config_grad_output_for_grad_weight: CastConfig | None = None
    gemm_config_output: Float8GemmConfig = Float8GemmConfig(use_fast_accum=True)
    gemm_config_grad_input: Float8GemmConfig = Float8GemmConfig()
    gemm_config_grad_weight: Float8GemmConfig = Float8GemmConfig()
    enable_fsdp_float8_all_gather: bool = False
    pad_inner_dim: bool = False
    emulate: bool = False
    force_recompute_fp8_weight_in_bwd: bool = False
    round_scales_to_power_of_2: bool = False
    _: KW_ONLY
    delayed_scaling_config: DelayedScalingConfig = field(default_factory=DelayedScalingConfig)
    save_input_in_float8: bool = False
    share_input_casts: bool = False

    def __post_init__(self) -> None:
        self._convert_foreign_fields()
        check_field_types(self)
        for operand in OPERANDS:
            self._resolve(operand)
        if self.force_recompute_fp8_weight_in_bwd:
            warn_force_recompute()
        casts = {key: self.cast(*key) for key in CAST_FIELD}
        check_cast_pairs(
            casts,
            fsdp_all_gather=self.enable_fsdp_float8_all_gather,
            save_input_in_float8=self.save_input_in_float8,
        )
        named = {CAST_FIELD[key]: cast for key, cast in casts.items()}
        check_linear_blocks(
            named, pad_inner_dim=self.pad_inner_dim, power_of_2=self.round_scales_to_power_of_2
        )
        if self.round_scales_to_power_of_2:
            check_static_power_of_2(named)
        check_gemm_configs(casts, self)
        check_delayed_scaling_config(
            self.delayed_scaling_config,
            DelayedScalingConfig(),
            read=ScalingType.DELAYED in self.scaling_types(),
        )
        input_kinds = {g: casts[(Operand.INPUT, g)].scaling_type for g in INPUT_GEMMS}
        check_share_input_casts(
            self.share_input_casts,
            {g: k.value for g, k in input_kinds.items() if k is not ScalingType.DYNAMIC},
        )
        if not self.emulate:
            check_no_e5m2_pair(casts)

    def _convert_foreign_fields(self) -> None:
        """torchao.float8's CastConfig / Float8GemmConfig (or any dataclass with their
        fields) in a cast or GEMM field becomes this package's, field by field
        (`foreign_part`); anything else is left to the type check."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.startswith(("cast_config_", "gemm_config_")) and _is_foreign(value):
                object.__setattr__(self, f.name, foreign_part(value, f.name))

    def _resolve(self, operand: Operand) -> None:
        """Fill the operand's second-use config and both target dtypes, as torchao fills
        them (`config_torchao.filled_casts`)."""
        first_name = CAST_FIELD[(operand, PRIMARY_GEMM[operand])]
        second_name = CAST_FIELD[(operand, SECOND_GEMM[operand])]
        given = (getattr(self, first_name), getattr(self, second_name))
        first, second = filled_casts(*given, operand)
        object.__setattr__(self, first_name, first)
        object.__setattr__(self, second_name, second)

    def cast(self, operand: Operand, gemm: Gemm) -> CastConfig:
        return getattr(self, CAST_FIELD[(operand, gemm)])

    def float8_dtype(self, operand: Operand, gemm: Gemm) -> torch.dtype:
        dtype = self.cast(operand, gemm).target_dtype
        assert dtype is not None  # filled by __post_init__
        return dtype

    def gemm_config(self, gemm: Gemm) -> Float8GemmConfig:
        return getattr(self, f"gemm_config_{gemm.value}")

    def strategy(self, operand: Operand, gemm: Gemm) -> scaling.ScalingStrategy | None:
        """The scaling strategy of one cast; None when the cast is disabled. The only place
        where `ScalingType`/`ScalingGranularity` words are turned into behaviour."""
        cfg = self.cast(operand, gemm)
        if cfg.scaling_type is ScalingType.DISABLED:
            return None
        if cfg.scaling_type is ScalingType.STATIC:
            assert cfg.static_scale is not None  # CastConfig.__post_init__ checked it
            return scaling.StaticScaling(scale=cfg.static_scale)
        if cfg.scaling_type is ScalingType.DELAYED:
            d = self.delayed_scaling_config
            return scaling.DelayedScaling(
                history_len=d.history_len,
                scale_fn_name=d.scale_fn_name,
                power_of_2=self.round_scales_to_power_of_2,
            )
        return scaling.DynamicScaling(
            granularity=cfg.granularity(), power_of_2=self.round_scales_to_power_of_2
        )

    def any_float8(self) -> bool:
        """False when every cast is disabled (all three GEMMs in high precision)."""
        return any(self.cast(op, g).enabled for (op, g) in CAST_FIELD)

    def uses_block_scales(self) -> bool:
        """True when any operand of any GEMM is cast with block scales (blockwise, mxfp8),
        which refuse pad_inner_dim."""
        return any(self.cast(op, g).block_shape is not None for (op, g) in CAST_FIELD)

    def scaling_types(self) -> set[ScalingType]:
        return {self.cast(op, g).scaling_type for (op, g) in CAST_FIELD}

    @classmethod
    def from_recipe_name(
        cls, recipe_name: Float8LinearRecipeName | str, **overrides
    ) -> Float8LinearConfig:
        """A named recipe (a `Float8LinearRecipeName` or its value: 'tensorwise',
        'rowwise', 'rowwise_with_gw_hp', 'blockwise', 'mxfp8'), with any field overridden
        by keyword."""
        casts, flags = recipe_fields(recipe_name)
        fields = {name: CastConfig(**kw) for name, kw in casts.items()}
        return cls(**{**fields, **flags, **overrides})

    @classmethod
    def tensorwise(cls, **overrides) -> Float8LinearConfig:
        return cls.from_recipe_name(Float8LinearRecipeName.TENSORWISE, **overrides)

    @classmethod
    def rowwise(cls, **overrides) -> Float8LinearConfig:
        return cls.from_recipe_name(Float8LinearRecipeName.ROWWISE, **overrides)

    @classmethod
    def rowwise_with_gw_hp(cls, **overrides) -> Float8LinearConfig:
        return cls.from_recipe_name(Float8LinearRecipeName.ROWWISE_WITH_GW_HP, **overrides)

    @classmethod
    def blockwise(cls, **overrides) -> Float8LinearConfig:
        return cls.from_recipe_name(Float8LinearRecipeName.BLOCKWISE, **overrides)

    @classmethod
    def mxfp8(cls, **overrides) -> Float8LinearConfig:
        return cls.from_recipe_name(Float8LinearRecipeName.MXFP8, **overrides)


def _is_foreign(value: object) -> bool:
    ours = (CastConfig, Float8GemmConfig)
    return dataclasses.is_dataclass(value) and not isinstance(value, (type, *ours))


def foreign_part(value: object, field: str) -> CastConfig | Float8GemmConfig:
    """A foreign cast or GEMM config (torchao.float8's) given inside this package's
    `Float8LinearConfig`, as this package's."""
    where = f"Float8LinearConfig.{field}"
    return foreign_value(value, where, type_name(value))  # type: ignore[return-value]


def foreign_value(value: Any, where: str, kind: str) -> object:
    """A field value of a foreign config (torchao.float8's): a cast or GEMM config
    dataclass as this package's (`config_torchao.foreign_fields`), an enum by its value,
    anything else as it is."""
    if isinstance(value, (CastConfig, Float8GemmConfig)) or not dataclasses.is_dataclass(value):
        return value.value if isinstance(value, enum.Enum) else value
    kw = foreign_fields(value, where, kind)
    if tuple(kw) == FOREIGN_GEMM_FIELDS:
        return Float8GemmConfig(kw["use_fast_accum"])
    return CastConfig(**kw)


_LINEAR_FIELDS = {f.name for f in dataclasses.fields(Float8LinearConfig)}


def as_float8_linear_config(config: object, argument: str = "config") -> Float8LinearConfig:
    """`config` itself when it is a `Float8LinearConfig` (None: the default one); a foreign
    config with the same fields (torchao.float8's) converted field by field (`foreign_value`;
    a `*_for_grad_*` cast equal to its operand's primary one is left for this package to
    fill in, as torchao filled it); else an error naming the type and what is expected. A
    field this package does not have is refused by name; nothing is guessed."""
    if config is None:
        return Float8LinearConfig()
    if isinstance(config, Float8LinearConfig):
        return config
    fields = foreign_linear_fields(config, argument, _LINEAR_FIELDS, foreign_value)
    return Float8LinearConfig(**fields)
