"""Block-scaled float8 weights ('blockwise' 128x128 float32 scales, 'mxfp8' 32x32 e8m0).

Quantize: a block scale depends only on the block's own values, so a rank whose dim-0 shard
starts on a block boundary casts its shard exactly as the unsharded weight would be cast
(no amax collective); shards not of whole blocks are refused (`check_block_shards`).

Pack: one `uint8` input in the payload codec's format (`fsdp_float8.core.payload`): shard
rows of `K` float8 bytes, each followed by `c` bytes of the shard's scales (float32, or
e8m0 for MX: 1 byte each), flattened and laid over the rows, `c = ceil(scale bytes / shard
rows)`; for a (4096, 4096) weight over 8 ranks that is 128x128: 1 byte a row, MX 32x32: 4
bytes a row, exactly the scales. One input, because at shard size 1 FSDP2 hands the
post-hook only the first. Square blocks are transpose-invariant: the gathered weight serves
both weight GEMMs, never re-cast (`operand_kind`, `build_operand`): as it is for the
emulated GEMM, which takes any layout; for the CUDA GEMM grad_input gets a column-major
copy and MX weights their e8m0 scales swizzled as that GEMM takes them, once per unshard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fsdp_float8.core.cast_plan import Cast, CastPlan
from fsdp_float8.core.families import FAMILIES
from fsdp_float8.core.float8_tensor import Float8Tensor
from fsdp_float8.core.gemms import Gemm, Operand
from fsdp_float8.core.payload import E8M0, PayloadLayout
from fsdp_float8.formats.operands import (
    AS_IS,
    CACHED,
    Pair,
    attach_operands,
    column_major,
    refilled,
    unsharded,
)
from fsdp_float8.formats.recast import recast_kind, recast_operand

FAMILY = FAMILIES["block"]  # its entry in the family table
# whether a shard's scale needs the whole weight's amax (read through `Family`)
NEEDS_GLOBAL_AMAX = FAMILY.needs_global_amax


def check_block_shards(rows: int, shards: int, block_rows: int, *, owner: str = "") -> None:
    """Every shard must start on a block boundary and be whole blocks; one shard (shard
    size 1) takes any number of rows. ``owner`` names the weight (the module FSDP2 passes
    to the pre-all-gather hook). Padding each shard to whole blocks would make the block
    grid, and so the rounding, depend on the shard count (the same model would train
    differently on another mesh) and would need a compacting copy after each all-gather."""
    if shards == 1 or (rows % shards == 0 and (rows // shards) % block_rows == 0):
        return
    what = owner or "a weight"
    raise ValueError(
        f"block-scaled float8 all-gather of {what} with {rows} rows over {shards} shards: "
        f"each shard must hold whole {block_rows}-row blocks (rows divisible by "
        f"{shards * block_rows}) so its block scales are its own; padding shards would make "
        "the rounding depend on the shard count. Use out_features divisible by "
        f"{shards * block_rows}, exclude this layer with module_filter_fn, or set "
        "enable_fsdp_float8_all_gather=False (gathered in high precision, cast after)"
    )


@dataclass(frozen=True)
class BlockGather:
    layout: PayloadLayout  # K float8 bytes + the shard's block scales spread over its rows
    emulate: bool
    block: tuple[int, int]
    shard_rows: int
    shard_scale_shape: tuple[int, ...]

    @classmethod
    def pack(
        cls,
        data: torch.Tensor,
        scale: torch.Tensor,
        scale_dtype: torch.dtype,
        emulate: bool,
        block: tuple[int, int],
    ) -> tuple[torch.Tensor, BlockGather]:
        rows, k = data.shape
        layout = PayloadLayout.fitting(data.dtype, scale_dtype, k, rows, scale.numel())
        meta = cls(layout, emulate, block, rows, tuple(scale.shape))
        return layout.encode(data, scale), meta

    @property
    def float8_dtype(self) -> torch.dtype:
        return self.layout.float8_dtype

    def unpack(self, gathered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole weight's float8 data (a view) and float32 block scales (a copy)."""
        shards = gathered.shape[0] // self.shard_rows
        sr, sc = self.shard_scale_shape
        scale = self.layout.scales(gathered, shards, math.prod(self.shard_scale_shape))
        return self.layout.data(gathered), scale.reshape(shards * sr, sc)

    def build(self, outputs: tuple[torch.Tensor, ...], param_dtype):
        # FSDP2 frees and re-allocates these around each use: the gathered buffer (the data
        # is a strided view of it) and the scales, always a copy
        gathered = outputs[0]
        data, scale = self.unpack(gathered)
        weight = Float8Tensor(data, scale, param_dtype, self.emulate, self.block)
        return weight, attach_operands(weight, [gathered, scale])

    def refill(self, out, outputs: tuple[torch.Tensor, ...]) -> None:
        _, scale = self.unpack(outputs[0])  # the data aliases the refilled all-gather output
        out = unsharded(out, outputs[0])
        out._scale.copy_(scale)
        refilled(out)


def gathered_by(weight: Float8Tensor) -> bool:
    """Whether this format's all-gather built `weight`: block scales."""
    return weight._block is not None


def operand_kind(weight: Float8Tensor, gemm: Gemm, plan: CastPlan) -> str:
    if gemm is Gemm.OUTPUT:
        return CACHED if _mx_on_cuda(weight, plan) else AS_IS
    if not plan.shared(Operand.WEIGHT):  # grad_input cast otherwise: from the rows
        return recast_kind(plan)
    # the emulated block GEMM takes any layout; a 3-D expert weight, its grouped GEMM's
    emulated = plan.emulate or not weight.is_cuda
    return AS_IS if emulated or weight._data.dim() != 2 else CACHED


def build_operand(
    weight: Float8Tensor, gemm: Gemm, plan: CastPlan, cast: Cast, context, out: Pair | None
) -> tuple[Pair, tuple[torch.Tensor, ...]]:
    """The CUDA GEMM's operand, into `out`'s buffers when given: grad_input's column-major;
    an MX weight's scales e8m0 and swizzled as the right operand of either GEMM."""
    if gemm is Gemm.GRAD_INPUT and not plan.shared(Operand.WEIGHT):
        return recast_operand(weight, plan, cast, context, out)
    data, scale = weight._data, weight._scale
    new: tuple[torch.Tensor, ...] = ()
    if gemm is Gemm.GRAD_INPUT:  # the weight is the right operand: column-major
        data, new = column_major(data, None if out is None else out[0])
    if not _mx_on_cuda(weight, plan):
        return (data, scale), new
    from fsdp_float8.core.blocks_cuda import swizzled_right_scale

    # the right operand's scale: W.t()'s for the output GEMM, W's for grad_input
    right = scale.t() if gemm is Gemm.OUTPUT else scale
    n = data.shape[0] if gemm is Gemm.OUTPUT else data.shape[1]
    swizzled = swizzled_right_scale(right, plan.blocks[gemm][1], n)
    if out is None:
        return (data, swizzled), (*new, swizzled)
    assert out[1] is not None
    out[1].copy_(swizzled)
    return (data, out[1]), new


def _mx_on_cuda(weight: Float8Tensor, plan: CastPlan) -> bool:
    """An MX weight for the CUDA GEMM, which takes its e8m0 scales swizzled."""
    return (
        weight._block is not None
        and weight.is_cuda
        and not plan.emulate
        and plan.scale_dtypes[Gemm.OUTPUT] == E8M0
    )
