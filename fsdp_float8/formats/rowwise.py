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
columns (`core.cast_plan.gathered_grad_input`), built once per unshard (`operands`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_float8.core.float8_tensor import Float8Tensor
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
