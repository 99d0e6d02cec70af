"""Rowwise float8 weights: one scale per output row (the output GEMM's contraction dim).

Quantize: a row's scale depends only on its own values, so each rank casts its dim-0 shard
alone (no amax collective for FSDP2; a row-parallel TP weight reduces over its TP group).

Pack: the float8 rows, their float32 scales and the scales' inverses (what the GEMMs
multiply by, made on the shard) as three `uint8` inputs, so FSDP2's copy-out gives each its
own contiguous buffer and the gathered data is the output GEMM's operand as it arrives (no
copy before the forward GEMM); K + 8 bytes a row. At shard size 1 FSDP2 hands the
post-hook only the first input, so there the scales and inverses travel in the metadata. Rows must split evenly
over the shards (the scales cannot be padded to FSDP2's padded shard size); every rank sees
the same sizes and refuses alike.

grad_input contracts over the rows, so its operand is the row-cast weight re-cast along the
columns (`build_operand`, by `fsdp_float8.formats.recast`), built once per unshard
(`operands`). The same re-cast serves a weight that is not gathered in float8
(`recast.grad_input_from_rows`), so a model's numerics do not depend on how it is sharded.

A plain weight (no float8 all-gather) compiled for a GPU is cast along its columns from its
high-precision values in one kernel (`column_cast`): its amax is taken over a transposed
copy, so Inductor sees a reduction along the contiguous dim, which it does not split, and
fuses the cast into it; over the weight itself the reduction runs across rows, which it
splits into two kernels and casts in a third.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_float8.core.cast_plan import Cast, CastPlan
from fsdp_float8.core.families import FAMILIES, one_scale, recipes_where
from fsdp_float8.core.float8_tensor import Float8Tensor
from fsdp_float8.core.gemms import Gemm, Operand
from fsdp_float8.core.scaling import DynamicScaling
from fsdp_float8.formats.operands import (
    AS_IS,
    Pair,
    attach_operands,
    plain_grad_input_cast,
    read_here,
    refilled,
    unsharded,
)
from fsdp_float8.formats.recast import recast_kind, recast_operand

FAMILY = FAMILIES["rowwise"]  # its entry in the family table
# whether a shard's scale needs the whole weight's amax (read through `Family`)
NEEDS_GLOBAL_AMAX = FAMILY.needs_global_amax


def check_rows(rows: int, shards: int) -> None:
    if rows % shards != 0:
        raise ValueError(
            f"rowwise float8 all-gather of a weight with {rows} rows over {shards} shards: "
            "FSDP2 needs every all-gather input at the padded shard size, which the row "
            f"scales cannot have; use rows divisible by the shard count, the "
            f"{recipes_where(one_scale)} recipe, or enable_fsdp_float8_all_gather=False"
        )


@dataclass(frozen=True, eq=False)
class RowwiseGather:
    float8_dtype: torch.dtype
    emulate: bool
    mid: tuple[int, ...]  # a 3-D expert weight (E, out, in): (out,); () for a 2-D weight
    # at shard size 1 FSDP2 hands the post-hook only the first input: the scales ride here
    local_scales: torch.Tensor | None = None
    local_inverses: torch.Tensor | None = None  # their `1 / scale`, made with them

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
        metadata): the data rows, the scales' bytes and their inverses' bytes as three
        `uint8` inputs, so FSDP2's copy-out gives each its own contiguous buffer (the data
        in the GEMM's layout, the inverses as the GEMM takes them)."""
        rows = data.reshape(-1, data.shape[-1]).view(torch.uint8)
        scales = scale.reshape(-1, 1).to(torch.float32)
        # what the GEMMs multiply by, made here on the shard, once per pack (which backward's
        # re-gather reuses), on the stream that packs; the compiled forward takes it as an
        # input (`Float8Tensor._inverse`) instead of computing it on the whole weight
        inverses = scales.reciprocal()
        if shards == 1:
            return (rows,), cls(data.dtype, emulate, mid, scales, inverses)
        parts = (rows, scales.view(torch.uint8), inverses.view(torch.uint8))
        return parts, cls(data.dtype, emulate, mid)

    def unpack(
        self, gathered: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Data, scales and their inverses as views of the all-gather outputs (of the
        metadata at shard size 1); a 3-D expert weight gets its shape back."""
        data = gathered[0].view(self.float8_dtype)
        local = self.local_scales
        scale = local if local is not None else gathered[1]
        inverse = self.local_inverses if self.local_inverses is not None else gathered[2]
        scale, inverse = scale.view(torch.float32), inverse.view(torch.float32)
        if self.mid:  # (E * out, in) rows back to (E, out, in)
            data = data.view(-1, *self.mid, data.shape[-1])
            scale, inverse = scale.view(-1, *self.mid, 1), inverse.view(-1, *self.mid, 1)
        return data, scale, inverse

    def build(self, outputs: tuple[torch.Tensor, ...], param_dtype):
        """Data, scales and inverses view the all-gather outputs, which FSDP2 frees and
        refills in place around each use; at shard size 1 the scales come in the metadata."""
        data, scale, inverse = self.unpack(outputs)
        if self.local_scales is None:
            weight = Float8Tensor(data, scale, param_dtype, self.emulate)
            weight._inverse = inverse
            return weight, attach_operands(weight, list(outputs))
        read_here(scale)
        read_here(inverse)
        # scales of its own, which FSDP2 frees with the data: the metadata's stay with the
        # pack, which the next all-gather may reuse (`weight_wrappers.base.pack_shard`)
        scale, inverse = scale.clone(), inverse.clone()
        weight = Float8Tensor(data, scale, param_dtype, self.emulate)
        weight._inverse = inverse
        return weight, attach_operands(weight, [outputs[0], scale, inverse])

    def refill(self, out, outputs: tuple[torch.Tensor, ...]) -> None:
        out = unsharded(out, outputs[0])
        if self.local_scales is not None:  # else the scales view the refilled outputs
            _, scale, inverse = self.unpack(outputs)
            read_here(scale)
            read_here(inverse)
            out._scale.copy_(scale)
            assert out._inverse is not None  # `build` set it
            out._inverse.copy_(inverse)
        refilled(out)


def gathered_by(weight: Float8Tensor) -> bool:
    """Whether this format's all-gather built `weight`: per-row scales, no blocks."""
    return weight._block is None and weight._scale.dim() > 0


def pack(data, scale, emulate: bool, mid: tuple[int, ...], *, shards: int):
    """A shard's all-gather inputs and metadata (`RowwiseGather.pack`)."""
    return RowwiseGather.pack(data, scale, emulate, mid, shards=shards)


def operand_kind(weight: Float8Tensor, gemm: Gemm, plan: CastPlan) -> str:
    """The output GEMM takes the gathered rows as they are; grad_input the rows re-cast
    along the columns (built once per unshard) where its cast's scale broadcasts, else a
    cast from the dequantized weight at each use."""
    return AS_IS if gemm is Gemm.OUTPUT else recast_kind(plan)


def build_operand(
    weight: Float8Tensor, gemm: Gemm, plan: CastPlan, cast: Cast, context, out: Pair | None
) -> tuple[Pair, tuple[torch.Tensor, ...]]:
    """grad_input's operand, into `out`'s buffers when given (`operand_kind`)."""
    return recast_operand(weight, plan, cast, context, out)


# where a compiled plain weight's column cast runs as one kernel (`column_cast`): GPU
# Inductor's reductions (CPU Inductor does not split a reduction across rows)
COLUMN_CAST_DEVICES = ("cuda",)


def plain_operand(weight: torch.Tensor, gemm: Gemm, plan: CastPlan) -> Pair | None:
    """A plain weight's operand for `gemm` where this format casts it itself (`column_cast`,
    `one_kernel_columns`); None: the layer's own cast."""
    if gemm is Gemm.GRAD_INPUT and one_kernel_columns(weight, plan):
        return column_cast(weight, plan)
    return None


def one_kernel_columns(weight: torch.Tensor, plan: CastPlan) -> bool:
    """Whether `column_cast` makes `weight`'s grad_input operand: compiled for a GPU, a 2-D
    high-precision weight (not gathered in float8, not a DTensor's shard of a reduced
    amax) whose grad_input cast is dynamic, per column, from its own amax."""
    if not torch.compiler.is_compiling():  # eager (every step): no call more
        return False
    strategy = plain_grad_input_cast(weight, plan, COLUMN_CAST_DEVICES)
    return (
        strategy is not None
        and not plan.shared(Operand.WEIGHT)
        and strategy.granularity.family is FAMILY
    )


def column_cast(weight: torch.Tensor, plan: CastPlan) -> Pair:
    """A plain (N, K) weight cast along its columns for grad_input (one scale per column,
    laid out column-major): the same bytes and scales as the layer's own cast
    (`nn.linear.cast_operand`), but the amax reads a transposed copy (K, N), which
    `as_strided` makes a buffer of its own (compiled, a plain copy would be folded into
    its reader and the reduction would run across rows again).
    Compiled on a GPU the copy, the amax and the cast fuse into one kernel that reads the
    weight once; the layer's cast takes three (module docstring)."""
    strategy = plan.strategies[(Operand.WEIGHT, Gemm.GRAD_INPUT)]
    assert isinstance(strategy, DynamicScaling)
    dtype = plan.dtypes[(Operand.WEIGHT, Gemm.GRAD_INPUT)]
    # a fresh buffer at offset 0 (`contiguous` would return a column-major weight's
    # transpose as it is, at its own storage offset)
    rows = weight.detach().t().clone(memory_format=torch.contiguous_format)
    rows = rows.as_strided(rows.shape, (rows.shape[1], 1), 0)
    scale = strategy.scale(rows, 1, dtype).t()  # (1, K): the amax of each column, exact
    # the scale is of the weight's own amax: no clamp (`cast_to_float8_data`)
    data = strategy.granularity.cast(weight, scale, 0, dtype, column_major=True, saturate=False)
    return data, scale
