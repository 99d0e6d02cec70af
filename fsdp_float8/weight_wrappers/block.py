"""Block-scaled weight ('blockwise' 128x128, 'mxfp8' 32x32): FSDP2 gathers float8 data and
the block scales together, with no amax collective.

Mental model: a block scale depends only on the block's own values, so a rank whose dim-0
shard starts on a block boundary can cast its shard exactly as the unsharded weight would
be cast: the gathered data and scales are bit for bit the unsharded cast, and the gathered
weight serves both weight GEMMs as it is (square blocks, `cast_plan.weight_for`).

Payload (one uint8 all-gather input, as for rowwise, `gather.BlockGather` in the format of
`fsdp_float8.core.payload`): shard rows of `K` float8 bytes, each followed by `c` bytes of scales.
The shard's scales (float32, or e8m0 for MX: 1 byte each) are flattened and laid over the
rows, `c = ceil(scale bytes / shard rows)`; for a (4096, 4096) weight over 8 ranks that is
128x128: 1 byte a row, MX 32x32: 4 bytes a row, exactly the scales (no padding).

Shard rows not on a block boundary (FSDP2 shards dim 0 evenly, with padding): refused, on
every rank alike (each sees the same sizes), with the remedy. Padding each shard to whole
blocks was the alternative; it would make the block grid, and so the rounding, depend on
the shard count (the same model would train differently on another mesh, and a resharded
checkpoint would cast differently) and would need a compacting copy after each all-gather.
"""

from __future__ import annotations

import torch

from fsdp_float8.weight_wrappers.base import Float8WeightWrapper
from fsdp_float8.weight_wrappers.gather import BlockGather


class BlockFloat8Weight(Float8WeightWrapper):
    @property
    def granularity(self):
        return self.strategy.granularity

    @property
    def block(self) -> tuple[int, int]:
        return self.granularity.block(-1)

    def float8_scale(self, mesh) -> torch.Tensor:
        return self.strategy.scale(self._tensor, -1, self.float8_dtype)  # the shard's own blocks

    def pack_shard(self, mesh, outer_size, module):
        dims = getattr(module, "in_features", None), getattr(module, "out_features", None)
        shape = f"({dims[0]}, {dims[1]})" if None not in dims else ""
        owner = f"the {tuple(outer_size)} weight of {type(module).__name__}{shape}"
        check_block_shards(outer_size[0], mesh.size(), self.block[0], owner=owner)
        scale = self.float8_scale(mesh)
        data = self.granularity.cast(self._tensor, scale, -1, self.float8_dtype)
        scale_dtype, emulate = self.granularity.scale_dtype, self._cast.emulate
        payload, meta = BlockGather.pack(data, scale, scale_dtype, emulate, self.block)
        return (payload,), meta


def check_block_shards(rows: int, shards: int, block_rows: int, *, owner: str = "") -> None:
    """Every shard must start on a block boundary and be whole blocks (see the module
    docstring); one shard (shard size 1) takes any number of rows. ``owner`` names the
    weight (the module FSDP2 passes to the pre-all-gather hook)."""
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
