"""Tensorwise float8 weights: one scale for the whole weight.

Quantize: the shard is cast with a scale from the amax of the *whole* weight (a cross-rank
MAX over the shard mesh, or the float8 step's one refresh collective), so every rank casts
with the same scale and the gathered bytes equal a cast of the unsharded weight.

Pack: the float8 bytes only, as one `uint8` input (gloo rejects float8 dtypes). The scale,
the same on every rank, travels as metadata: under uneven sharding FSDP2 demands every input
at exactly the padded shard size, which leaves the data no room for it. The gathered data
serves both weight GEMMs (a tensorwise scale is the same whichever dim is contracted):
grad_input gets a column-major copy, never a re-cast (`operand_kind`, `build_operand`). The
unsharded weight keeps its scale and the scale's inverse (what both GEMMs multiply by) side
by side in one 2-element tensor of its own: written by one op per all-gather, read by no op
per GEMM. The float8 step stamps a weight's scale as such a pair as well (the refresh makes
every inverse in one op), which the all-gather copies as it is: one record of both, from
the refresh to the GEMM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fsdp_float8.core.cast_plan import Cast, CastPlan
from fsdp_float8.core.families import FAMILIES
from fsdp_float8.core.float8_tensor import Float8Tensor
from fsdp_float8.core.gemms import Gemm, Operand
from fsdp_float8.core.scaling import (
    DynamicScaling,
    cast_to_float8_data,
    least_row_scale,
    stacked_scales,
)
from fsdp_float8.formats.operands import (
    AS_IS,
    CACHED,
    Pair,
    attach_operands,
    column_major,
    plain_grad_input_cast,
    read_here,
    refilled,
    unsharded,
)

FAMILY = FAMILIES["tensorwise"]  # its entry in the family table
# whether a shard's scale needs the whole weight's amax (read through `Family`)
NEEDS_GLOBAL_AMAX = FAMILY.needs_global_amax


def gathered_by(weight: Float8Tensor) -> bool:
    """Whether this format's all-gather built `weight`: one scale, no blocks."""
    return weight._block is None and weight._scale.dim() == 0


def operand_kind(weight: Float8Tensor, gemm: Gemm, plan: CastPlan) -> str:
    """The output GEMM and a 3-D expert weight's grouped GEMMs take the gathered data as it
    is; grad_input of a 2-D weight its column-major copy, built once per unshard."""
    return AS_IS if gemm is Gemm.OUTPUT or weight._data.dim() != 2 else CACHED


def build_operand(
    weight: Float8Tensor, gemm: Gemm, plan: CastPlan, cast: Cast, context, out: Pair | None
) -> tuple[Pair, tuple[torch.Tensor, ...]]:
    """grad_input's operand: the same float8 bytes and scale, column-major."""
    data, new = column_major(weight._data, None if out is None else out[0])
    return (data, weight._scale), new


# where a compiled plain weight's one-scale grad_input cast takes its scale from the row
# scales of its output GEMM cast (`columns_from_row_scales`): GPU Inductor's reductions (its
# amax over the whole weight is two kernels, then a third casts and a fourth expands the
# scale for the row-scaled GEMM)
ROW_SCALE_DEVICES = ("cuda",)


def from_row_scales(weight: torch.Tensor, plan: CastPlan) -> bool:
    """Whether a plain weight cast per row for the output GEMM takes its one grad_input
    scale from those rows' scales (`columns_from_row_scales`): compiled for a GPU, a 2-D
    high-precision weight with rows and columns, both casts dynamic from the weight's own
    amax (no reduction over a group) with one scale rule (float8 dtype, power-of-two
    rounding), the rows not re-cast for grad_input (`CastPlan.weight_from_rows`)."""
    if not torch.compiler.is_compiling():  # eager (every step): no call more
        return False
    columns = plain_grad_input_cast(weight, plan, ROW_SCALE_DEVICES)
    rows = plan.strategies[(Operand.WEIGHT, Gemm.OUTPUT)]
    return (
        columns is not None
        and weight.numel() > 0
        and columns.granularity.family is FAMILY
        and isinstance(rows, DynamicScaling)
        and rows.group is None
        and rows.granularity.per_row  # one scale per row, which broadcasts (no blocks)
        and rows.granularity.broadcast_scales
        and rows.power_of_2 == columns.power_of_2
        and plan.dtypes[(Operand.WEIGHT, Gemm.OUTPUT)]
        == plan.dtypes[(Operand.WEIGHT, Gemm.GRAD_INPUT)]
    )


def columns_from_row_scales(
    weight: torch.Tensor, row_scale: torch.Tensor, plan: CastPlan
) -> tuple[Pair, torch.Tensor]:
    """grad_input's operand of a plain (N, K) weight with one scale, from the (N, 1) scales
    of its output GEMM's row cast (`from_row_scales`), with the scale's inverse: the same
    bytes and scale as the layer's cast (`core.scaling.least_row_scale` says why), laid out
    column-major, the scale and inverse as the (1, K) vectors the row-scaled GEMM takes.
    Compiled on a GPU: one small kernel reduces the row scales (the partitioner runs it in
    forward or in backward, whichever keeps fewer bytes between them), one casts the
    weight; the layer's cast reads the weight for an amax (two kernels), casts it, and
    expands the scale in a fourth."""
    dtype = plan.dtypes[(Operand.WEIGHT, Gemm.GRAD_INPUT)]
    scale, inverse = least_row_scale(row_scale, weight.shape[1])
    # the scale is of the weight's own amax: no clamp (`cast_to_float8_data`)
    data = cast_to_float8_data(weight, scale, dtype, column_major=True, saturate=False)
    return (data, scale), inverse


def pack(
    data: torch.Tensor,
    scale: torch.Tensor,
    outer_size,
    shards: int,
    emulate: bool,
    scales: torch.Tensor | None = None,
) -> tuple[tuple[torch.Tensor, ...], TensorwiseGather]:
    """The float8 shard as one `uint8` input, padded to the padded shard size. `scales`:
    (scale, 1 / scale) as one 2-element tensor whose [0] is `scale`, when the caller has
    it (the float8 step's refresh stamps it, all inverses in one op)."""
    data_bytes = data.view(torch.uint8)
    padded_rows = math.ceil(outer_size[0] / shards)
    if data_bytes.shape[0] < padded_rows:  # uneven sharding: every rank sends the padded size
        padding = [0, 0] * (data_bytes.dim() - 1) + [0, padded_rows - data_bytes.shape[0]]
        data_bytes = F.pad(data_bytes, padding)
    return (data_bytes,), TensorwiseGather(scale, data.dtype, emulate, scales)


@dataclass(frozen=True, eq=False)
class TensorwiseGather:
    scale: torch.Tensor  # 0-d float32, the same on every rank
    float8_dtype: torch.dtype
    emulate: bool
    scales: torch.Tensor | None = None  # (scale, 1 / scale), when known already

    def _scales(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """(scale, 1 / scale) as one tensor: a fresh one, or written into `out`."""
        known = self.scales
        if known is not None:  # one op: a copy of the stamp's pair
            if known.is_cuda:
                read_here(known)
            return known.clone() if out is None else out.copy_(known)
        read_here(self.scale)
        inverse = self.scale.reciprocal()
        if out is None:
            return torch.stack((self.scale, inverse))
        return torch.stack((self.scale, inverse), out=out)

    def unpack(self, gathered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gathered.view(self.float8_dtype), self.scale

    def build(self, outputs: tuple[torch.Tensor, ...], param_dtype):
        data, _ = self.unpack(outputs[0])
        # a scale of its own: `self.scale` is shared (the wrapper's stamped scale; static
        # scaling: one cached tensor for every layer)
        scales = self._scales()
        weight = Float8Tensor(data, scales[0], param_dtype, self.emulate)
        weight._inverse = scales[1]
        return weight, attach_operands(weight, [data], scales)

    def refill(self, out, outputs: tuple[torch.Tensor, ...]) -> None:
        out = unsharded(out, outputs[0])
        record = out._operands
        if record is not None and record.scales is not None:
            self._scales(out=record.scales)  # `out._scale` views its [0]
            record.refilled()
            return
        read_here(self.scale)
        out._scale.copy_(self.scale)
        refilled(out)


@dataclass(frozen=True)
class JointCast:
    """The output GEMM's input and weight cast together (`joint_cast`): `x` and `w` are
    row-major views of one float8 buffer (the output GEMM's operands); `columns` holds the
    same bytes transposed, (K, M + N), for backward (`joint_columns`): grad_weight's input
    and grad_input's weight, with no re-cast and no transposed copy there."""

    x: Pair
    w: Pair
    columns: torch.Tensor


def joint_columns(columns: torch.Tensor, m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The column-major input (M, K) and weight (N, K) in a `JointCast.columns` buffer
    (K, M + N): views with leading dimension M + N, which the float8 GEMMs take as they are
    (`core.gemm.scaled_mm_data`)."""
    assert columns.shape[0] == k, (tuple(columns.shape), k)
    return columns[:, :m].t(), columns[:, m:].t()


def joint_cast(x: torch.Tensor, w: torch.Tensor, plan: CastPlan) -> JointCast:
    """The output GEMM's two dynamic tensorwise casts, of input `x` (M, K) and weight `w`
    (N, K), as one (`CastPlan.joint_output_cast` says when a plan allows it): the rows of
    both stacked (they share K), one amax reduction over groups of rows and both scales
    from it (`core.scaling.stacked_scales`), one cast pass writing the stacked rows. The
    same bytes and scales as separate casts (a max is exact; each row is multiplied by its
    own tensor's scale, with no clamp, as `cast_to_float8_data` with `saturate=False`).
    Compiled on a GPU, that is three kernels where separate casts take six (an amax pass,
    the scales, and one cast pass that reads each value once and writes it in both
    layouts), and backward re-casts no weight.
    Memory: backward keeps the transposed copy, (M + N) x K bytes, where separate casts
    keep the input's M x K (and re-cast the weight). Needs M and N multiples of 16 (the
    views' offsets and leading dims stay 16-byte aligned, as the float8 GEMMs need)."""
    m, k = x.shape
    n = w.shape[0]
    x_strategy = plan.strategies[(Operand.INPUT, Gemm.OUTPUT)]
    w_strategy = plan.strategies[(Operand.WEIGHT, Gemm.OUTPUT)]
    assert isinstance(x_strategy, DynamicScaling) and isinstance(w_strategy, DynamicScaling)
    dtype = plan.dtypes[(Operand.INPUT, Gemm.OUTPUT)]
    both = torch.cat([x.detach(), w.detach()])
    x_scale, w_scale = stacked_scales(
        both, m, dtype, power_of_2=(x_strategy.power_of_2, w_strategy.power_of_2)
    )
    is_x = torch.arange(m + n, device=both.device) < m
    scaled = both * torch.where(is_x, x_scale, w_scale).unsqueeze(1)
    # as_strided: compiled, the buffer is written once and its readers read it in place (a
    # slice of a value not yet written would be computed again for each reader)
    rows = scaled.to(dtype).as_strided((m + n, k), (k, 1), 0)
    x_rows, w_rows = rows[:m], rows[m:]
    # the same cast transposed, (K, M + N): one node over the same elements as the rows,
    # which Inductor writes from the same kernel (each value read once, stored twice)
    # rather than as a copy that reads the float8 rows back
    columns = scaled.to(dtype).t().contiguous()
    return JointCast(x=(x_rows, x_scale), w=(w_rows, w_scale), columns=columns)
