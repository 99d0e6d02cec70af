"""What a float8 weight all-gather sends, per scale format: one frozen metadata class each.

Mental model. The pre-all-gather hook casts the local shard and returns its all-gather
input(s) plus metadata; the post-all-gather hook hands the gathered outputs to that
metadata: `build` makes the unsharded weight (a `Float8Tensor` viewing the gathered bytes)
and the inner tensors FSDP2 frees and refills; `refill` updates an unsharded weight after
FSDP2 refilled those buffers in place (the data already views them; scales that travel as
metadata are copied in). FSDP2 passes the metadata through untouched, so it is a typed,
named record instead of a positional tuple:

- `TensorwiseGather`: the float8 bytes only; the one scale (the same on every rank) travels
  as metadata, because under uneven sharding FSDP2 demands every input at exactly the padded
  shard size, which leaves the data no room for it.
- `RowwiseGather`: the float8 rows and their float32 scales as two `uint8` inputs, so the
  gathered data is contiguous, in the layout the forward GEMM takes (no copy); at shard
  size 1 (no collective) the scales travel in the metadata.
- `BlockGather`: the shard's block scales (float32 or e8m0) laid over the shard's rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fsdp_float8.core.float8_tensor import Float8Tensor
from fsdp_float8.core.payload import PayloadLayout


def _unsharded(out) -> Float8Tensor:
    if not isinstance(out, Float8Tensor):
        raise TypeError(f"expected the unsharded Float8Tensor as out, got {type(out)}")
    return out


def _read_here(scale: torch.Tensor) -> None:
    """A scale made on FSDP2's all-gather copy-in stream, read on the current stream:
    without this the caching allocator may hand its memory to the next block's prefetch
    (on the copy-in stream) before the read has run."""
    if scale.is_cuda:
        scale.record_stream(torch.cuda.current_stream(scale.device))


@dataclass(frozen=True, eq=False)
class TensorwiseGather:
    scale: torch.Tensor  # 0-d float32, the same on every rank
    float8_dtype: torch.dtype
    emulate: bool

    def unpack(self, gathered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gathered.view(self.float8_dtype), self.scale

    def build(self, outputs: tuple[torch.Tensor, ...], param_dtype):
        data, scale = self.unpack(outputs[0])
        _read_here(scale)
        # a scale of its own: `self.scale` is shared (the wrapper's stamped scale; static
        # scaling: one cached tensor for every layer)
        return Float8Tensor(data, scale.clone(), param_dtype, self.emulate), (data,)

    def refill(self, out, outputs: tuple[torch.Tensor, ...]) -> None:
        _read_here(self.scale)
        _unsharded(out)._scale.copy_(self.scale)


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
            return Float8Tensor(data, scale, param_dtype, self.emulate), outputs
        _read_here(scale)
        return Float8Tensor(data, scale, param_dtype, self.emulate), (outputs[0], scale)

    def refill(self, out, outputs: tuple[torch.Tensor, ...]) -> None:
        out = _unsharded(out)
        if self.local_scales is not None:  # else the scales view the refilled outputs
            _, scale = self.unpack(outputs)
            _read_here(scale)
            out._scale.copy_(scale)


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
        return weight, (gathered, scale)

    def refill(self, out, outputs: tuple[torch.Tensor, ...]) -> None:
        _, scale = self.unpack(outputs[0])  # the data aliases the refilled all-gather output
        _unsharded(out)._scale.copy_(scale)
