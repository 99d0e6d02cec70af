"""A weight as the operand of each GEMM: `weight_for`, the one entry the layers call.

The formats' side of the family table (`fsdp_float8.core.families`): each float8 family's
place (`PLACES`, `place_of`). A `Float8Tensor` gathered by the FSDP2 float8 all-gather is
asked of the format that built it (`format_of`): each format module says whether a GEMM takes the gathered data as it is,
an operand built once per unshard (kept in the weight's `GatheredOperands`), or a cast made
at each use (`operand_kind`), and builds it (`build_operand`). Any other weight is cast from
high precision by the layer's own cast; with a per-row float8 all-gather configured, its
grad_input operand is re-cast from its rows (`formats.recast`), as a gathered weight's is, so a model's
numerics do not depend on how it is sharded.
"""

from __future__ import annotations

from functools import partial
from importlib import import_module
from types import ModuleType
from typing import Protocol

import torch

from fsdp_float8.core.cast_plan import Cast, CastPlan
from fsdp_float8.core.families import FAMILIES, Family
from fsdp_float8.core.float8_tensor import Float8Tensor
from fsdp_float8.core.gemms import Gemm, Operand
from fsdp_float8.formats.operands import AS_IS, CAST, Pair
from fsdp_float8.formats.recast import grad_input_from_rows

# family name -> its place, for the families whose place is a module of this package
PLACES: dict[str, ModuleType] = {
    name: import_module(family.place)
    for name, family in FAMILIES.items()
    if family.place.startswith(f"{__package__}.")
}


class Format(Protocol):
    """What a format module says about its gathered weight's GEMM operands."""

    def operand_kind(self, weight: Float8Tensor, gemm: Gemm, plan: CastPlan) -> str: ...

    def build_operand(
        self,
        weight: Float8Tensor,
        gemm: Gemm,
        plan: CastPlan,
        cast: Cast,
        context,
        out: Pair | None,
    ) -> tuple[Pair, tuple[torch.Tensor, ...]]: ...


def place_of(family: Family) -> ModuleType:
    """The module holding `family`'s quantize, pack, gather record and operands."""
    if family.name not in PLACES:
        raise ValueError(
            f"format family {family.name!r} has no float8 all-gather place; expected one of "
            f"{sorted(PLACES)}"
        )
    return PLACES[family.name]


def joint_place(plan: CastPlan) -> ModuleType:
    """The place whose `joint_cast` casts the output GEMM's input and weight as one (the
    input's family, where `CastPlan.joint_output_cast` allows it)."""
    strategy = plan.strategies[(Operand.INPUT, Gemm.OUTPUT)]
    assert strategy is not None  # a joint cast is of two float8 casts
    return place_of(strategy.granularity.family)


def format_of(weight: Float8Tensor) -> Format:
    """The format whose all-gather built `weight`, by the shape of its scale (its blocks,
    one scale, or one per row), as each place says (`gathered_by`)."""
    for place in PLACES.values():
        if place.gathered_by(weight):
            return place
    raise TypeError(
        f"no format gathers a Float8Tensor with scale {tuple(weight._scale.shape)} and "
        f"block {weight._block}; expected a weight of one of {sorted(PLACES)}"
    )


def weight_for(weight: torch.Tensor, gemm: Gemm, plan: CastPlan, cast: Cast, context) -> Pair:
    """The weight as the (data, scale) pair of `gemm`, in the layout its GEMM takes."""
    if isinstance(weight, Float8Tensor):  # pre-cast by the FSDP2 float8 all-gather
        fmt = format_of(weight)
        kind = fmt.operand_kind(weight, gemm, plan)
        if kind == AS_IS:
            return weight._data, weight._scale
        build = partial(fmt.build_operand, weight, gemm, plan, cast, context)
        # under torch.compile the graph builds the operand (the record is not traced)
        cache = None if torch.compiler.is_compiling() else weight._operands
        if cache is None or kind == CAST:
            return build(None)[0]
        return cache.operand(gemm, build)
    if gemm is Gemm.GRAD_INPUT and plan.weight_from_rows:
        rows = cast(weight, Operand.WEIGHT, Gemm.OUTPUT, plan, context)
        return grad_input_from_rows(rows, plan, cast, context)
    strategy = plan.strategies[(Operand.WEIGHT, gemm)]
    place = None if strategy is None else PLACES.get(strategy.granularity.family.name)
    own = getattr(place, "plain_operand", None)  # a place's own cast of a plain weight
    operand = None if own is None else own(weight, gemm, plan)
    if operand is not None:
        return operand
    return cast(weight, Operand.WEIGHT, gemm, plan, context)
