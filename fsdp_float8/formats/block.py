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
both weight GEMMs as it is, never re-cast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fsdp_float8.core.float8_tensor import Float8Tensor
from fsdp_float8.core.payload import PayloadLayout
from fsdp_float8.formats.tensorwise import attach_operands, refilled, unsharded

NEEDS_GLOBAL_AMAX = False


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
