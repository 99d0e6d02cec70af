"""The format families by name: the one table that maps the words users write (recipe
names, `ScalingGranularity` values) to a family, and says what generic code asks of one.

A family's mechanics live in its place (`Family.place`): how a shard is quantized and
packed for the FSDP2 all-gather, its typed gather record, its GEMM operands and GEMM call
(`fsdp_float8.formats.tensorwise`, `.rowwise`, `.block`; the 4-bit family, which registers
itself here (`register`), in its own modules). Everything else asks a family's properties here (through
`fsdp_float8.core.scaling`'s granularity objects or `ScalingGranularity.family`) and names no
format: whether a shard's scale needs the whole weight's amax, whether its scales are per
row, whether they broadcast against the operand (any float8 GEMM, tensor parallelism, the
grouped expert GEMMs) or are blocks (a block GEMM), and which recipes to suggest. Also the
config rules that belong to one family (`all_gather_rule`), so their messages name it.

Imports nothing but `core/config_fields`: every module (core's included) can read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fsdp_float8.core.config_fields import Float8ConfigError


def _one_scale_all_gather(fwd, bwd) -> None:
    """One gathered float8 weight (one scale) serves both weight GEMMs: one dtype, one
    scaling type, one granularity."""
    if fwd.target_dtype != bwd.target_dtype or bwd.scaling_type != fwd.scaling_type:
        raise Float8ConfigError(
            "enable_fsdp_float8_all_gather=True with a tensorwise weight gathers one "
            "float8 weight for both weight GEMMs; give cast_config_weight_for_grad_input "
            "the same dtype and scaling type as cast_config_weight (or leave it None)"
        )
    if bwd.scaling_granularity != fwd.scaling_granularity:
        raise Float8ConfigError(
            "a tensorwise gathered weight cannot serve an axiswise grad_input cast; make "
            "cast_config_weight_for_grad_input tensorwise (or leave it None)"
        )


def _rows_all_gather(fwd, bwd) -> None:
    """The grad_input weight is re-cast from the gathered rows: any dynamic cast (a per-row
    cast is dynamic only, so the second-use rule made grad_input's dynamic too)."""


def _square_blocks_all_gather(fwd, bwd) -> None:
    """A gathered block weight serves both weight GEMMs as it is: one cast, so square
    blocks (the same whichever dim is contracted) and one config for both GEMMs."""
    if fwd != bwd or fwd.block_shape[0] != fwd.block_shape[1]:
        raise Float8ConfigError(
            "enable_fsdp_float8_all_gather=True with a blockwise weight gathers one float8 "
            "weight for both weight GEMMs, which needs square blocks and one cast config; "
            f"got cast_config_weight={fwd}, cast_config_weight_for_grad_input={bwd}; use "
            "square blocks (e.g. (128, 128)) and leave the grad_input one None"
        )


@dataclass(frozen=True)
class Family:
    name: str
    # the `ScalingGranularity` value of its float8 casts; None: a layer of its own (the 4-bit one)
    granularity: str | None
    recipes: tuple[str, ...]  # its named recipes (`Float8LinearRecipeName` values)
    short: str  # its granularity's word in a layer's repr (torchao's: ten, axs)
    # a shard's scale needs the whole weight's amax: a cross-rank MAX, or the float8 step's
    # one refresh collective (the weight's precomputed scale)
    needs_global_amax: bool
    # one scale per row along the contraction dim: a dim-0 shard's scales are its own, and
    # grad_input (contracting over the rows) gets the rows re-cast along the columns
    per_row: bool
    # scales broadcast against the operand: torch._scaled_mm on any float8 GPU, tensor
    # parallelism, the grouped expert GEMMs; else block scales for a block GEMM
    broadcast_scales: bool
    # the output GEMM's float8 input serves grad_weight too (`save_input_in_float8`)
    saves_float8_input: bool
    # how a float8 all-gathered weight's config must be to serve both weight GEMMs
    all_gather_rule: Callable[[object, object], None] | None
    place: str  # the module holding its quantize, pack, gather record, operands, GEMM


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "tensorwise",
            "tensorwise",
            ("tensorwise",),
            "ten",
            needs_global_amax=True,
            per_row=False,
            broadcast_scales=True,
            saves_float8_input=True,
            all_gather_rule=_one_scale_all_gather,
            place="fsdp_float8.formats.tensorwise",
        ),
        Family(
            "rowwise",
            "axiswise",
            ("rowwise", "rowwise_with_gw_hp"),
            "axs",
            needs_global_amax=False,
            per_row=True,
            broadcast_scales=True,
            saves_float8_input=False,
            all_gather_rule=_rows_all_gather,
            place="fsdp_float8.formats.rowwise",
        ),
        Family(
            "block",
            "blockwise",
            ("blockwise", "mxfp8"),
            "blk",
            needs_global_amax=False,
            per_row=False,
            broadcast_scales=False,
            saves_float8_input=True,
            all_gather_rule=_square_blocks_all_gather,
            place="fsdp_float8.formats.block",
        ),
    )
}


def register(family: Family) -> Family:
    """Add a family that lives outside the float8 casts (the 4-bit layer registers its own
    from its weight wrapper); a name is registered once."""
    if family.name in FAMILIES:
        raise ValueError(f"format family {family.name!r} is registered already")
    if family.granularity is not None and family.granularity in _BY_GRANULARITY:
        raise ValueError(f"scaling granularity {family.granularity!r} has a family already")
    FAMILIES[family.name] = family
    if family.granularity is not None:
        _BY_GRANULARITY[family.granularity] = family
    return family


# the recipe a config or a trainer gets when it names none
DEFAULT_RECIPE = FAMILIES["tensorwise"].recipes[0]


_BY_GRANULARITY = {f.granularity: f for f in FAMILIES.values() if f.granularity is not None}


def of_granularity(value: str) -> Family:
    """The family whose float8 casts have `ScalingGranularity` value `value`."""
    family = _BY_GRANULARITY.get(value)
    if family is None:
        raise ValueError(
            f"no format family has scaling granularity {value!r}; expected one of "
            f"{sorted(_BY_GRANULARITY)}"
        )
    return family


def recipes_where(test: Callable[[Family], bool], joiner: str = "or") -> str:
    """The recipe names of the families passing `test`, quoted, for a message's remedy:
    "'tensorwise', 'rowwise' or 'rowwise_with_gw_hp'"."""
    names = [f"'{r}'" for f in FAMILIES.values() if test(f) for r in f.recipes]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {joiner} {names[-1]}"


def granularities_where(test: Callable[[Family], bool], joiner: str = "or") -> str:
    """The granularity words of the families passing `test`: "tensorwise or axiswise"."""
    words = [f.granularity for f in FAMILIES.values() if test(f) and f.granularity]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} {joiner} {words[-1]}"


def broadcasting(family: Family) -> bool:
    """A float8 family whose scales broadcast (no block GEMM needed)."""
    return family.broadcast_scales and family.granularity is not None


def one_scale(family: Family) -> bool:
    """A float8 family with one scale for the whole operand."""
    return family.needs_global_amax and family.granularity is not None


def recipe_where(test: Callable[[Family], bool]) -> str:
    """The first recipe name of the families passing `test` (a message's example)."""
    return next(r for f in FAMILIES.values() if test(f) for r in f.recipes)


def scaled_per_row(family: Family) -> bool:
    """A float8 family with one scale per row along the contraction dim."""
    return family.per_row


def families_where(test: Callable[[Family], bool], joiner: str = "or") -> str:
    """The names of the families passing `test`, each with its granularity word where that
    differs: "tensorwise and rowwise (axiswise)"."""
    words = [
        f.name if f.granularity in (None, f.name) else f"{f.name} ({f.granularity})"
        for f in FAMILIES.values()
        if test(f)
    ]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} {joiner} {words[-1]}"
