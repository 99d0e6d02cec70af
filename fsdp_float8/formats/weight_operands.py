"""A weight as the operand of each GEMM: `weight_for`, the one entry the layers call.

A `Float8Tensor` gathered by the FSDP2 float8 all-gather is asked of the format that built
it (`format_of`): each format module says whether a GEMM takes the gathered data as it is,
an operand built once per unshard (kept in the weight's `GatheredOperands`), or a cast made
at each use (`operand_kind`), and builds it (`build_operand`). Any other weight is cast from
high precision by the layer's own cast; with a rowwise float8 all-gather configured, its
grad_input operand is re-cast from its rows, as a gathered weight's is, so a model's
numerics do not depend on how it is sharded.
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

import torch

from fsdp_float8.core.cast_plan import Cast, CastPlan
from fsdp_float8.core.float8_tensor import Float8Tensor
from fsdp_float8.core.gemms import Gemm, Operand
from fsdp_float8.formats import block, rowwise, tensorwise
from fsdp_float8.formats.operands import AS_IS, CAST, Pair


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


def format_of(weight: Float8Tensor) -> Format:
    """The format whose all-gather built `weight`: block scales, one scale, or row scales."""
    if weight._block is not None:
        return block
    return tensorwise if weight._scale.dim() == 0 else rowwise


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
        return rowwise.grad_input_from_rows(rows, plan, cast, context)
    return cast(weight, Operand.WEIGHT, gemm, plan, context)
