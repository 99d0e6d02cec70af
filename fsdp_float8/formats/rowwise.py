"""Rowwise float8 weights: one scale per output row (the output GEMM's contraction dim).

Quantize: a row's scale depends only on its own values, so each rank casts its dim-0 shard
alone (no amax collective for FSDP2; a row-parallel TP weight reduces over its TP group).

Pack: the float8 rows and their float32 scales as two `uint8` inputs, so FSDP2's copy-out
gives each its own contiguous buffer and the gathered data is the output GEMM's operand as
it arrives (no copy before the forward GEMM). At shard size 1 FSDP2 hands the post-hook
only the first input, so there the scales travel in the metadata. Rows must split evenly
over the shards (the scales cannot be padded to FSDP2's padded shard size); every rank sees
the same sizes and refuses alike.

grad_input contracts over the rows, so its operand is the row-cast weight re-cast along the
columns (`build_operand`), built once per unshard (`operands`). The same re-cast serves a
weight that is not gathered in float8 (`grad_input_from_rows`), so a model's numerics do
not depend on how it is sharded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_float8.core.cast_plan import Cast, CastPlan
from fsdp_float8.core.float8_tensor import Float8Tensor
from fsdp_float8.core.gemms import Gemm, Operand
from fsdp_float8.core.scaling import Axiswise, DynamicScaling, Tensorwise
from fsdp_float8.formats.operands import AS_IS, CACHED, CAST, Pair
from fsdp_float8.formats.tensorwise import attach_operands, read_here, refilled, unsharded

NEEDS_GLOBAL_AMAX = False


def check_rows(rows: int, shards: int) -> None:
    if rows % shards != 0:
        raise ValueError(
            f"rowwise float8 all-gather of a weight with {rows} rows over {shards} shards: "
            "FSDP2 needs every all-gather input at the padded shard size, which the row "
            "scales cannot have; use rows divisible by the shard count, the 'tensorwise' "
            "recipe, or enable_fsdp_float8_all_gather=False"
        )


@dataclass(frozen=True, eq=False)
class RowwiseGather:
    float8_dtype: torch.dtype
    emulate: bool
    mid: tuple[int, ...]  # a 3-D expert weight (E, out, in): (out,); () for a 2-D weight
    # at shard size 1 FSDP2 hands the post-hook only the first input: the scales ride here
    local_scales: torch.Tensor | None = None

    @classmethod
    def pack(
        cls,
        data: torch.Tensor,
        scale: torch.Tensor,
        emulate: bool,
        mid: tuple[int, ...],
        *,
        shards: int,
    ) -> tuple[tuple[torch.Tensor, ...], RowwiseGather]:
        """float8 data (..., K) with its per-row scales (..., 1) -> (all-gather inputs,
        metadata): the data rows and the scales' bytes as two `uint8` inputs, so FSDP2's
        copy-out gives each its own contiguous buffer (the data in the GEMM's layout)."""
        rows = data.reshape(-1, data.shape[-1]).view(torch.uint8)
        scales = scale.reshape(-1, 1).to(torch.float32)
        if shards == 1:
            return (rows,), cls(data.dtype, emulate, mid, scales)
        return (rows, scales.view(torch.uint8)), cls(data.dtype, emulate, mid)

    def unpack(self, gathered: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Data and scales as views of the all-gather outputs (the scales of metadata at
        shard size 1); a 3-D expert weight gets its shape back."""
        data = gathered[0].view(self.float8_dtype)
        scale = self.local_scales if self.local_scales is not None else gathered[1]
        scale = scale.view(torch.float32)
        if self.mid:  # (E * out, in) rows back to (E, out, in)
            data, scale = data.view(-1, *self.mid, data.shape[-1]), scale.view(-1, *self.mid, 1)
        return data, scale

    def build(self, outputs: tuple[torch.Tensor, ...], param_dtype):
        """Data and scales view the all-gather outputs, which FSDP2 frees and refills in
        place around each use; at shard size 1 the scales come in the metadata."""
        data, scale = self.unpack(outputs)
        if self.local_scales is None:
            weight = Float8Tensor(data, scale, param_dtype, self.emulate)
            return weight, attach_operands(weight, list(outputs))
        read_here(scale)
        # scales of its own, which FSDP2 frees with the data: the metadata's stay with the
        # pack, which the next all-gather may reuse (`weight_wrappers.base.pack_shard`)
        scale = scale.clone()
        weight = Float8Tensor(data, scale, param_dtype, self.emulate)
        return weight, attach_operands(weight, [outputs[0], scale])

    def refill(self, out, outputs: tuple[torch.Tensor, ...]) -> None:
        out = unsharded(out, outputs[0])
        if self.local_scales is not None:  # else the scales view the refilled outputs
            _, scale = self.unpack(outputs)
            read_here(scale)
            out._scale.copy_(scale)
        refilled(out)


def operand_kind(weight: Float8Tensor, gemm: Gemm, plan: CastPlan) -> str:
    """The output GEMM takes the gathered rows as they are; grad_input the rows re-cast
    along the columns (built once per unshard) where its cast's scale broadcasts, else a
    cast from the dequantized weight at each use."""
    if gemm is Gemm.OUTPUT:
        return AS_IS
    return CACHED if _recast_columns(plan) else CAST


def build_operand(
    weight: Float8Tensor, gemm: Gemm, plan: CastPlan, cast: Cast, context, out: Pair | None
) -> tuple[Pair, tuple[torch.Tensor, ...]]:
    """grad_input's operand, into `out`'s buffers when given (`operand_kind`)."""
    data, scale = weight._data, weight._scale
    if not _recast_columns(plan):
        return grad_input_from_rows((data, scale), plan, cast, context), ()
    strategy = plan.strategies[(Operand.WEIGHT, Gemm.GRAD_INPUT)]
    assert isinstance(strategy, DynamicScaling)
    dtype = plan.dtypes[(Operand.WEIGHT, Gemm.GRAD_INPUT)]
    return _columns_from_rows(data, scale, strategy, dtype, out, _pow2_rows(plan))


def _recast_columns(plan: CastPlan) -> bool:
    """grad_input's weight cast is dynamic with a scale that broadcasts (per column, or
    tensorwise): the row-cast weight is re-cast in place; blocks need their own cast."""
    strategy = plan.strategies[(Operand.WEIGHT, Gemm.GRAD_INPUT)]
    return isinstance(strategy, DynamicScaling) and isinstance(
        strategy.granularity, (Tensorwise, Axiswise)
    )


def grad_input_from_rows(rows: Pair, plan: CastPlan, cast: Cast, context) -> Pair:
    """The grad_input operand from a row-cast weight (sharded or not, so a model's numerics
    do not depend on how it is sharded)."""
    scale = rows[1]
    if scale is None or scale.dim() == 0 or plan.shared(Operand.WEIGHT):
        return rows
    # grad_input contracts over the rows: re-cast from the row-cast weight (no extra bytes
    # gathered; grad_input SQNR within ~0.1 dB (rowwise) / ~2.5 dB (tensorwise,
    # rowwise_with_gw_hp) of a cast from hp)
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
) -> tuple[Pair, tuple[torch.Tensor, ...]]:
    """A row-cast (N, K) weight (or (E, N, K), one per expert) re-cast along N for
    grad_input, in the GEMM's column-major layout: one float32 (K, N) buffer, dequantized,
    scaled and clamped in place, plus the amax's transient |x| (a bf16 weight cast from hp
    writes ~1.75 float32 weights' bytes). The same values as dequantize-then-cast
    (elementwise ops, exact max). With `out`, the float8 columns are written into its
    buffer; the new buffers returned are the columns only (FSDP2 frees them with the
    weight), the K scales are kept as made."""
    hp_t = data.mT.to(torch.float32, memory_format=torch.contiguous_format)
    if pow2_rows:  # x / s is x * (1 / s) exactly: one op
        hp_t.div_(row_scale.mT)
    else:  # as the dequantization rounds
        hp_t.mul_(row_scale.reciprocal().mT)
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
