"""Block-scaled weight ('blockwise' 128x128, 'mxfp8' 32x32): FSDP2 gathers float8 data and
the block scales together, with no amax collective. The format (payload, shard rule, the
gathered weight) is `fsdp_float8.formats.block`; this wrapper only says where the scale
comes from: the shard's own blocks.
"""

from __future__ import annotations

import torch

from fsdp_float8.formats.block import BlockGather, check_block_shards
from fsdp_float8.weight_wrappers.base import Float8WeightWrapper

__all__ = ["BlockFloat8Weight", "check_block_shards"]


class BlockFloat8Weight(Float8WeightWrapper):
    @property
    def granularity(self):
        return self.strategy.granularity

    needs_row_shards = True

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
