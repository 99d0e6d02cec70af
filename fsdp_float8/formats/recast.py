"""A gathered weight re-cast for a GEMM its gathered cast does not serve.

grad_input contracts over a weight's rows. A weight gathered with per-row scales (or with
blocks whose grad_input cast differs) gets its grad_input operand as the gathered weight
re-cast along the columns (`recast_operand`): where grad_input's cast is dynamic with a
scale that broadcasts, the float8 rows are dequantized, scaled and cast in place, built once
per unshard (`recast_kind` says CACHED); otherwise (a block cast) a cast from the
dequantized weight at each use (CAST). The same re-cast serves a weight that is not gathered
in float8 (`grad_input_from_rows`), so a model's numerics do not depend on how it is sharded.
"""

from __future__ import annotations

import torch

from fsdp_float8.core.cast_plan import Cast, CastPlan
from fsdp_float8.core.float8_tensor import Float8Tensor
from fsdp_float8.core.gemms import Gemm, Operand
from fsdp_float8.core.scaling import DynamicScaling
from fsdp_float8.formats.operands import CACHED, CAST, Pair


def recast_kind(plan: CastPlan) -> str:
    """grad_input's operand: re-cast once per unshard where its cast's scale broadcasts,
    else a cast from the dequantized weight at each use."""
    return CACHED if _recast_columns(plan) else CAST


def recast_operand(
    weight: Float8Tensor, plan: CastPlan, cast: Cast, context, out: Pair | None
) -> tuple[Pair, tuple[torch.Tensor, ...]]:
    """grad_input's operand, into `out`'s buffers when given (`recast_kind`)."""
    data, scale = weight._data, weight._scale
    if not _recast_columns(plan):
        return grad_input_from_rows((data, scale), plan, cast, context), ()
    strategy = plan.strategies[(Operand.WEIGHT, Gemm.GRAD_INPUT)]
    assert isinstance(strategy, DynamicScaling)
    dtype = plan.dtypes[(Operand.WEIGHT, Gemm.GRAD_INPUT)]
    inverse = weight._inverse  # a gathered weight's, made with its scales
    return _columns_from_rows(data, scale, strategy, dtype, out, _pow2_rows(plan), inverse)


def _recast_columns(plan: CastPlan) -> bool:
    """grad_input's weight cast is dynamic with a scale that broadcasts (per column, or
    one scale): the row-cast weight is re-cast in place; blocks need their own cast."""
    strategy = plan.strategies[(Operand.WEIGHT, Gemm.GRAD_INPUT)]
    return isinstance(strategy, DynamicScaling) and strategy.granularity.broadcast_scales


def grad_input_from_rows(rows: Pair, plan: CastPlan, cast: Cast, context) -> Pair:
    """The grad_input operand from a row-cast weight (sharded or not, so a model's numerics
    do not depend on how it is sharded)."""
    scale = rows[1]
    if scale is None or scale.dim() == 0 or plan.shared(Operand.WEIGHT):
        return rows
    # grad_input contracts over the rows: re-cast from the row-cast weight (no extra bytes
    # gathered; grad_input SQNR within ~0.1 dB (per-column re-cast) / ~2.5 dB (one-scale
    # re-cast) of a cast from hp)
    strategy = plan.strategies[(Operand.WEIGHT, Gemm.GRAD_INPUT)]
    if _recast_columns(plan):
        assert isinstance(strategy, DynamicScaling)
        dtype = plan.dtypes[(Operand.WEIGHT, Gemm.GRAD_INPUT)]
        return _columns_from_rows(rows[0], scale, strategy, dtype, None, _pow2_rows(plan))[0]
    hp = rows[0].to(torch.float32)
    hp.mul_(scale.reciprocal())  # in place: the one float32 copy of the weight
    return cast(hp, Operand.WEIGHT, Gemm.GRAD_INPUT, plan, context)


def _pow2_rows(plan: CastPlan) -> bool:
    """Whether the weight's row scales (its output GEMM cast) are powers of two."""
    strategy = plan.strategies[(Operand.WEIGHT, Gemm.OUTPUT)]
    return isinstance(strategy, DynamicScaling) and strategy.power_of_2


def _columns_from_rows(
    data: torch.Tensor,
    row_scale: torch.Tensor,
    strategy: DynamicScaling,
    dtype: torch.dtype,
    out: Pair | None,
    pow2_rows: bool,
    row_inverse: torch.Tensor | None = None,
) -> tuple[Pair, tuple[torch.Tensor, ...]]:
    """A row-cast (N, K) weight (or (E, N, K), one per expert) re-cast along N for
    grad_input, in the GEMM's column-major layout: one float32 (K, N) buffer, dequantized,
    scaled and clamped in place, plus the amax's transient |x| (a bf16 weight cast from hp
    writes ~1.75 float32 weights' bytes). The same values as dequantize-then-cast
    (elementwise ops, exact max). With `out`, the float8 columns are written into its
    buffer; the new buffers returned are the columns only (FSDP2 frees them with the
    weight), the K scales are kept as made. `row_inverse`: `1 / row_scale`, when made
    already."""
    hp_t = data.mT.to(torch.float32, memory_format=torch.contiguous_format)
    if pow2_rows:  # x / s is x * (1 / s) exactly: one op
        hp_t.div_(row_scale.mT)
    else:  # as the dequantization rounds
        hp_t.mul_((row_scale.reciprocal() if row_inverse is None else row_inverse).mT)
    scale = strategy.scale(hp_t, -1, dtype)  # (..., K, 1) or 0-d
    hp_t.mul_(scale)  # the scale of hp_t's own amax: no clamp (`cast_to_float8_data`)
    scale_t = scale.mT if scale.dim() >= 2 else scale
    if out is None:
        columns = hp_t.to(dtype)
        return (columns.mT, scale_t), (columns,)
    columns = out[0].mT
    columns.copy_(hp_t)  # the cast to float8, as `.to(dtype)` rounds
    # the scale (K floats) is the fresh one: a copy into a kept buffer would be an op more
    return (out[0], scale_t), ()
