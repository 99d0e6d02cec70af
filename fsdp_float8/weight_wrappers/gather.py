"""What a float8 weight all-gather sends, per scale format: one frozen metadata class each.

Mental model. The pre-all-gather hook casts the local shard and returns ONE all-gather input
plus metadata; the post-all-gather hook turns the gathered output back into float8 data and
scales with that metadata (`unpack`). FSDP2 passes the metadata through untouched, so it is a
typed, named record instead of a positional tuple:

- `TensorwiseGather`: the float8 bytes only; the one scale (the same on every rank) travels
  as metadata, because under uneven sharding FSDP2 demands every input at exactly the padded
  shard size, which leaves the data no room for it.
- `RowwiseGather`: each row's float32 scale rides as 4 more bytes of that row
  (`fsdp_float8.core.payload`: float8 bytes + scales in one uint8 buffer).
- `BlockGather`: the shard's block scales (float32 or e8m0) laid over the shard's rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fsdp_float8.core.payload import PayloadLayout


@dataclass(frozen=True, eq=False)
class TensorwiseGather:
    scale: torch.Tensor  # 0-d float32, the same on every rank
    float8_dtype: torch.dtype
    emulate: bool

    def unpack(self, gathered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gathered.view(self.float8_dtype), self.scale


@dataclass(frozen=True)
class RowwiseGather:
    layout: PayloadLayout  # K float8 bytes + 4 float32 scale bytes a row
    emulate: bool
    mid: tuple[int, ...]  # a 3-D expert weight (E, out, in): (out,); () for a 2-D weight

    @classmethod
    def pack(
        cls, data: torch.Tensor, scale: torch.Tensor, emulate: bool, mid: tuple[int, ...]
    ) -> tuple[torch.Tensor, RowwiseGather]:
        """float8 data (..., K) with its per-row scales (..., 1) -> (payload, metadata)."""
        rows = data.reshape(-1, data.shape[-1])
        layout = PayloadLayout(data.dtype, torch.float32, rows.shape[1], 4)
        return layout.encode(rows, scale.reshape(-1, 1)), cls(layout, emulate, mid)

    @property
    def float8_dtype(self) -> torch.dtype:
        return self.layout.float8_dtype

    def unpack(self, gathered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Data and scales as views of the gathered bytes (a copy of the scales when the
        row length leaves them unaligned); a 3-D expert weight gets its shape back."""
        data = self.layout.data(gathered)
        scale = self.layout.scales(gathered, gathered.shape[0], 1)
        if self.mid:  # (E * out, in) rows back to (E, out, in)
            data, scale = data.view(-1, *self.mid, data.shape[-1]), scale.view(-1, *self.mid, 1)
        return data, scale


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
