"""The saturating cast: high precision times a scale, clamped to the float8 range, converted.

A scale multiplies hp into float8 range (`fsdp_float8.core.scaling` makes it); this module
only applies one. It reduces nothing, so it serves every granularity whose scale broadcasts
against its operand (one 0-d scale, or one per row); block scales cast in
`fsdp_float8.core.blocks`.
"""

from __future__ import annotations

import torch


def float8_max(float8_dtype: torch.dtype) -> float:
    return float(torch.finfo(float8_dtype).max)


_UPCAST_IN_MUL = (torch.bfloat16, torch.float16, torch.float32)  # exact upcasts to float32


def cast_to_float8_data(
    hp: torch.Tensor,
    scale: torch.Tensor,
    float8_dtype: torch.dtype,
    *,
    column_major: bool = False,
    saturate: bool = True,
) -> torch.Tensor:
    """Saturating cast: clamp(hp * scale) to the float8 range, then convert.

    `saturate=False` (the scale's amax covers `hp`: `ScalingStrategy.own_amax`) skips the
    clamp: |hp * scale| <= fp8_max up to float32 rounding, which the conversion rounds to
    fp8_max, so the bytes are the same.

    Out of place: selective activation checkpointing may save any op's output (a
    save-everything policy does) and refuses one mutated afterwards; under torch.compile it
    is one fused kernel either way. `column_major` (2-D `hp`): the result is laid out
    column-major, as the right operand of a GEMM needs it (or the left one, transposed):
    the transposed copy is the first float32 copy, not an extra pass over the float8 data."""
    src = hp.detach()
    if column_major:
        src, scale = src.t(), (scale.t() if scale.dim() == 2 else scale)
        scaled = src.to(torch.float32, memory_format=torch.contiguous_format) * scale
    elif src.dtype in _UPCAST_IN_MUL and src.dim() > 0 and src.is_contiguous():
        # one op: a scale with dims makes the product float32 (a 0-d one would not)
        scaled = src * (scale if scale.dim() > 0 else scale.reshape(1))
    else:
        scaled = src.to(torch.float32, memory_format=torch.contiguous_format) * scale
    if saturate:
        fmax = float8_max(float8_dtype)
        scaled = torch.clamp(scaled, min=-fmax, max=fmax)
    data = scaled.to(float8_dtype)
    return data.t() if column_major else data
