"""The CUDA block-scaled GEMM: `torch.nn.functional.scaled_mm` with block ScalingTypes.

Follows PyTorch's `scaled_mm` documentation and its CUDA tests (test_scaled_matmul_cuda,
torch 2.13). Checked by the fake-CUDA lane (tests/fakecuda: shapes, layouts, dtypes) and,
on a GPU with the kernel, by tests/gpu/test_block_cuda.py (against the float32 emulation).
What it asks of the device and shapes (`cuda_block_gemm_problem` says which is missing):
- float32 block scales (DeepSeek-style): SM90 (H100/H200) exactly; pairs (1x128, 128x128),
  (1x128, 1x128), (128x128, 1x128) along K; M, N, K multiples of 128. Scales go in as
  dequantization factors (1 / scale), 1x128 ones "outer-dim-major" (stride 1 along M/N),
  128x128 ones as (K/128 padded to a multiple of 4, rows/128) with stride 1 along K.
- e8m0 scales (MX): SM100+ (Blackwell); 1x32 along K on both operands (a 32x32 weight
  block is repeated to its 32 rows of 1x32 tiles); scales swizzled (SWIZZLE_32_4_4:
  128x4 tiles of the scale matrix laid out as 32x16, rows padded to 128, columns to 4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fsdp_float8.core._compat import scaled_mm_v2
from fsdp_float8.core.families import broadcasting, recipes_where
from fsdp_float8.core.payload import E8M0, e8m0_from_scale

_FP32_PAIRS = {((1, 128), (128, 128)), ((1, 128), (128, 1)), ((128, 128), (128, 1))}


def cuda_block_gemm_problem(device, a_block, b_block, scale_dtype, m, n, k) -> str | None:
    """Why this torch/device cannot run the block GEMM natively; None when it can."""
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return "this torch has no torch.nn.functional.scaled_mm (needs torch >= 2.10)"
    major, minor = torch.cuda.get_device_capability(device)
    if scale_dtype == E8M0:
        if (a_block, b_block) not in (((1, 32), (32, 1)), ((1, 32), (32, 32))):
            return f"MX blocks {a_block} x {b_block}; the MX GEMM takes 1x32 along K"
        if major < 10:
            return f"MXFP8 GEMMs need SM100 or newer (Blackwell); {device} is SM{major}{minor}"
        return None if k % 32 == 0 else f"MXFP8 GEMM with K={k}: K must be a multiple of 32"
    if (a_block, b_block) not in _FP32_PAIRS:
        return f"blocks {a_block} x {b_block}; SM90 takes {sorted(_FP32_PAIRS)}"
    if (major, minor) != (9, 0):
        return f"1x128/128x128 block GEMMs run on SM90 only; {device} is SM{major}{minor}"
    if m % 128 or n % 128 or k % 128:
        return f"block GEMM with M={m}, N={n}, K={k}: each must be a multiple of 128"
    return None


def cuda_block_scaled_mm(a, a_scale, a_block, b, b_scale, b_block, out_dtype, fast, scale_dtype):
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    problem = cuda_block_gemm_problem(a.device, a_block, b_block, scale_dtype, m, n, k)
    if problem is not None:
        raise ValueError(
            f"block-scaled float8 GEMM on {a.device}: {problem}. Set "
            "Float8LinearConfig(emulate=True) to run the same numerics emulated in float32, "
            f"or use the {recipes_where(broadcasting)} recipe on this device"
        )
    st = F.ScalingType
    a = a.contiguous()
    b = b.t().contiguous().t()  # column-major
    if scale_dtype == E8M0:
        sa = swizzle_32_4_4(e8m0_from_scale(a_scale))
        # a gathered weight's scale comes swizzled, built once per unshard (e8m0 already)
        sb = b_scale if b_scale.dtype == E8M0 else swizzled_right_scale(b_scale, b_block, n)
        # torch._scaled_mm reads swizzled e8m0 scales as MX 1x32 blocks; Inductor (torch
        # 2.11) keeps its operands' layouts, not those of _scaled_mm_v2 with e8m0 scales
        return torch._scaled_mm(a, b, sa, sb, out_dtype=out_dtype)
    inv_a, inv_b = a_scale.reciprocal(), b_scale.reciprocal()
    if a_block == (1, 128):
        ra, sa = st.BlockWise1x128, inv_a.t().contiguous().t()  # (M, K/128), M-major
    else:
        ra, sa = st.BlockWise128x128, _k_padded_t(inv_a)  # (L4, M/128), stride (1, L4)
    if b_block == (128, 1):
        rb, sb = st.BlockWise1x128, inv_b.contiguous().t()  # (N, K/128), N-major
    else:
        rb, sb = st.BlockWise128x128, _k_padded_t(inv_b.t())  # (L4, N/128), stride (1, L4)
    return scaled_mm_v2(a, b, [sa], [ra], [sb], [rb], output_dtype=out_dtype, use_fast_accum=fast)


def swizzled_right_scale(scale: torch.Tensor, block, n: int) -> torch.Tensor:
    """The MX GEMM's right-operand scale from the float32 block scales of b (K, N): e8m0,
    one per 1x32 tile along K of each of b's N columns (a 32x32 weight block is repeated
    to its 32 columns), swizzled (`swizzle_32_4_4`)."""
    if block == (32, 32):  # each weight row of a 32x32 block is a 1x32 tile
        scale = scale.repeat_interleave(32, dim=1)[:, :n]
    return swizzle_32_4_4(e8m0_from_scale(scale.t()))


def _k_padded_t(scale: torch.Tensor) -> torch.Tensor:
    """A (rows/128, K/128) 128x128 scale with K/128 padded to a multiple of 4 (L4), stored
    row-major and handed over transposed: the layout PyTorch's tests give the kernel."""
    padded = F.pad(scale, (0, -scale.shape[1] % 4)).contiguous()
    return padded.t()


def swizzle_32_4_4(scale: torch.Tensor) -> torch.Tensor:
    """(R, C) one-byte block scales (e8m0, e4m3) in the blocked layout of cuBLAS block-scaled
    GEMMs, same dtype: rows padded to 128 and columns to 4 (with zero bytes), each 128x4
    tile stored as 32 rows of 16 (row r of the tile at (r % 32, 4 * (r // 32) + c)), tiles
    in row-major order, flattened."""
    r, c = scale.shape
    raw = scale.view(torch.uint8)
    raw = F.pad(raw, (0, -c % 4, 0, -r % 128))
    tr, tc = raw.shape[0] // 128, raw.shape[1] // 4
    tiles = raw.reshape(tr, 4, 32, tc, 4).permute(0, 3, 2, 1, 4)  # (tr, tc, 32, 4, 4)
    return tiles.reshape(-1).view(scale.dtype)
