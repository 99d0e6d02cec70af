"""Block scales: one scale per block of a 2-D tensor, and the block-scaled GEMM.

Mental model. A tensor (..., R, C) is tiled by blocks of (br, bc) elements from its top-left
corner; leading dims (e.g. experts) are batch dims, each 2-D slice tiled alike. The scale
has one float32 entry per block, shape (..., ceil(R / br), ceil(C / bc)), in the package's
convention (`scale` multiplies hp into float8 range, `fsdp_float8.core.float8_tensor`). A last
partial block (R or C not a multiple) is treated as zero-padded: a zero changes no amax,
and the padding is cut off again, so any shape works.

Scale formats. float32 (DeepSeek-style 1x128 / 128x128, optionally a power of two), or
e8m0 (MX, `torch.float8_e8m0fnu`): an 8-bit biased exponent, the float32 exponent bits of
the dequantization factor `1 / scale` (bias 127, as float32's; the one convention,
`fsdp_float8.core.payload`). Rounding of the shared
exponent: RCEIL, i.e. the smallest power of two `2^e >= amax / fp8_max`, so the block's
largest element never saturates. It is exactly `round_down_to_power_of_2(fp8_max / amax)`
of `fsdp_float8.core.scaling` (DynamicScaling with power_of_2=True); the OCP MX v1.0 spec's
own rule, `2^(floor(log2 amax) - emax)`, can clamp elements and is not used.

The block-scaled GEMM `block_scaled_mm` (a (M, K) @ b (K, N)):
- emulated (CPU always, `emulate=True` anywhere), defined exactly: each operand is
  dequantized block by block in float32, `float32(fp8) * float32(1 / scale of its block)`
  (one rounding per element), then one float32 matmul, rounded once to `out_dtype`.
  CPU `torch._scaled_mm` rejects block scales, and itself dequantizes and runs a float32
  GEMM, so this is what a CPU float8 GEMM is.
- CUDA: `torch.nn.functional.scaled_mm` with its `BlockWise1x128` /
  `BlockWise128x128` (SM90) or `BlockWise1x32` with swizzled e8m0 scales (SM100), where
  `cuda_block_gemm_problem` finds no obstacle; otherwise a ValueError naming what the
  device lacks (`core/blocks_cuda.py`; checked by the fake-CUDA lane and tests/gpu).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Block = tuple[int, int]


def scale_shape(shape: torch.Size | tuple[int, ...], block: Block) -> tuple[int, ...]:
    """Shape of the scale of a tensor of `shape` tiled by `block`."""
    *lead, r, c = shape
    return (*lead, -(-r // block[0]), -(-c // block[1]))


def blocked(x: torch.Tensor, block: Block) -> torch.Tensor:
    """x (..., R, C), zero-padded to whole blocks, viewed as (..., R/br, br, C/bc, bc)."""
    br, bc = block
    *lead, r, c = x.shape
    pad_r, pad_c = -r % br, -c % bc
    if pad_r or pad_c:
        x = F.pad(x, (0, pad_c, 0, pad_r))
    return x.reshape(*lead, (r + pad_r) // br, br, (c + pad_c) // bc, bc)


def _unblocked(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    *lead, sr, br, sc, bc = x.shape
    return x.reshape(*lead, sr * br, sc * bc)[..., : shape[-2], : shape[-1]]


def _per_block(scale: torch.Tensor) -> torch.Tensor:
    return scale[..., :, None, :, None]


def _check_scale(scale: torch.Tensor, shape, block: Block) -> None:
    want = scale_shape(shape, block)
    if tuple(scale.shape) != want:
        raise ValueError(
            f"a block scale for a tensor of shape {tuple(shape)} in {block[0]}x{block[1]} "
            f"blocks has shape {want}, got {tuple(scale.shape)}; compute it with "
            "fsdp_float8.core.scaling.block_amax(hp, block) for the same block"
        )


def cast_to_float8_blocks(
    hp: torch.Tensor, scale: torch.Tensor, block: Block, float8_dtype: torch.dtype
) -> torch.Tensor:
    """Saturating cast with one scale per block: clamp(hp * scale of its block), to float8,
    in hp's shape (row-major)."""
    _check_scale(scale, hp.shape, block)
    fmax = float(torch.finfo(float8_dtype).max)
    # out of place: selective activation checkpointing refuses a saved output mutated later
    x = blocked(hp.detach().to(torch.float32), block)
    x = torch.clamp(x * _per_block(scale), min=-fmax, max=fmax)
    return _unblocked(x, hp.shape).to(float8_dtype, memory_format=torch.contiguous_format)


def dequantize_blocks(
    data: torch.Tensor, scale: torch.Tensor, block: Block, out_dtype=torch.float32
) -> torch.Tensor:
    """float32(data) * float32(1 / scale of its block), then out_dtype."""
    _check_scale(scale, data.shape, block)
    x = blocked(data.to(torch.float32), block) * _per_block(scale.reciprocal())
    return _unblocked(x, data.shape).to(out_dtype)


def expand_block_scale(scale: torch.Tensor, block: Block, shape) -> torch.Tensor:
    """The block scale repeated over its block's elements: full `shape`, float32."""
    *lead, r, c = shape  # `_check_scale` (it raises) only on a mismatch: no call per GEMM
    if scale.shape != (*lead, -(-r // block[0]), -(-c // block[1])):
        _check_scale(scale, shape, block)
    full = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return full[..., : shape[-2], : shape[-1]]


def _dequantize(data, scale, block: Block | None) -> torch.Tensor:
    if block is None:  # tensorwise or axiswise: the scale broadcasts
        return data.to(torch.float32) * scale.reciprocal()
    return dequantize_blocks(data, scale, block)


def block_scaled_mm(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    a_block: Block | None,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    b_block: Block | None,
    *,
    out_dtype: torch.dtype,
    emulate: bool,
    use_fast_accum: bool = False,
    scale_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """a (M, K) @ b (K, N), at least one operand block-scaled (`*_block` is its (rows, cols)
    block; None for a tensorwise/axiswise operand whose scale broadcasts)."""
    if emulate or not a_data.is_cuda:
        a = _dequantize(a_data, a_scale, a_block)
        b = _dequantize(b_data, b_scale, b_block)
        return torch.mm(a, b).to(out_dtype)
    from fsdp_float8.core.blocks_cuda import cuda_block_scaled_mm

    return cuda_block_scaled_mm(
        a_data, a_scale, a_block, b_data, b_scale, b_block, out_dtype, use_fast_accum, scale_dtype
    )
