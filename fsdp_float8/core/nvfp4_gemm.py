"""NVFP4 GEMMs: products of two quantized tensors (`core/nvfp4.py`), emulated or cuBLAS FP4.

`nvfp4_mm(a, b)` = a (M, K) @ b (N, K)^T, both quantized along K. On CUDA SM100+
(Blackwell) one cuBLAS FP4 GEMM (`F.scaled_mm`): the codes as float4_e2m1fn_x2 with K
zero-padded to a multiple of 32, b column-major, per operand the scales [e4m3 factors of
1x16 blocks swizzled SWIZZLE_32_4_4 (a 16x16 tile's factor repeated over its 16 rows), the
float32 tensor factor] with recipe [BlockWise1x16, TensorWise]. On CPU (no FP4 GEMM there)
and with `emulate=True`, `emulated_mm`: both dequantized, one float32 matmul. A CUDA device
below SM100 is refused (`check_nvfp4_gemm_device`) naming the remedy, emulate=True.
A weight's right operands are built once (`gemm_operand_parts`, `GemmOperand`: the output
GEMM's and grad_input's, its tiles transposed) and taken as they are (`prepared_mm`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fsdp_float8.core._compat import scaled_mm_v2
from fsdp_float8.core.blocks_cuda import swizzle_32_4_4
from fsdp_float8.core.e2m1 import FLOAT4
from fsdp_float8.core.nvfp4 import E4M3, NVFP4, dequantize, transposed


def _check_mm(a: NVFP4, b: NVFP4) -> None:
    # on the packed shapes (no `shape` call per GEMM): the same K <=> the same packed K
    pa, pb = a.packed.shape, b.packed.shape
    if len(pa) != 2 or len(pb) != 2 or pa[1] != pb[1]:
        raise ValueError(
            f"an NVFP4 GEMM takes a (M, K) and b (N, K) with the same K, got {tuple(a.shape)} "
            f"and {tuple(b.shape)}; quantize the right operand transposed"
        )


def emulated_mm(a: NVFP4, b: NVFP4, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """a (M, K) @ b (N, K)^T, both quantized along K (their last dim, as `F.linear`'s input
    and weight): each dequantized to float32, one float32 matmul, then `out_dtype`."""
    _check_mm(a, b)
    return emulated_mm_op(
        a.packed, a.block_inv_scale, a.tensor_inv_scale, list(a.block),
        b.packed, b.block_inv_scale, b.tensor_inv_scale, list(b.block), out_dtype,
    )  # fmt: skip


def _emulated_mm_impl(
    a_packed: torch.Tensor,
    a_block_inv: torch.Tensor,
    a_tensor_inv: torch.Tensor,
    a_block: list[int],
    b_packed: torch.Tensor,
    b_block_inv: torch.Tensor,
    b_tensor_inv: torch.Tensor,
    b_block: list[int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    a = NVFP4(a_packed, a_block_inv, a_tensor_inv, (a_block[0], a_block[1]))
    b = NVFP4(b_packed, b_block_inv, b_tensor_inv, (b_block[0], b_block[1]))
    return torch.mm(dequantize(a), dequantize(b).t()).to(out_dtype)


# One op, as a GEMM is one kernel: a compiled graph rounds its output to out_dtype where
# eager does (inductor would otherwise fuse the rounding into the op after it)
emulated_mm_op = torch.library.custom_op("fsdp_float8::nvfp4_emulated_mm", mutates_args=())(
    _emulated_mm_impl
)


@emulated_mm_op.register_fake
def _emulated_mm_fake(a_packed, a_block_inv, a_tensor_inv, a_block, b_packed, *rest):
    out_dtype = rest[-1]
    return a_packed.new_empty((a_packed.shape[0], b_packed.shape[0]), dtype=out_dtype)


def nvfp4_gemm_problem(device: torch.device) -> str | None:
    """Why the CUDA `device` cannot run FP4 GEMMs; None when it can (SM100+, Blackwell)."""
    if torch.version.hip is not None:
        return f"ROCm torch has no NVFP4 scaled_mm ({device})"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (10, 0):
        return f"NVFP4 GEMMs need SM100 or newer (Blackwell); {device} is SM{major}{minor}"
    return None


def check_nvfp4_gemm_device(device: torch.device | str, *, emulate: bool) -> None:
    """Refuse a CUDA device without FP4 GEMMs unless `emulate` (a meta device is judged by
    the current CUDA device, if any). CPU and other devices pass: they always emulate."""
    device = torch.device(device)
    if emulate:
        return
    if device.type == "meta" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    problem = nvfp4_gemm_problem(device) if device.type == "cuda" else None
    if problem is not None:
        raise ValueError(
            f"{problem}. Set NVFP4Config(emulate=True) to run the same NVFP4 numerics with "
            "emulated GEMMs (operands dequantized to float32) on this device, or train it "
            "with a float8 recipe"
        )


def _cuda_operand(q: NVFP4) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """q (R, K) as `F.scaled_mm` takes it: the codes as float4_e2m1fn_x2 with K zero-padded
    to a multiple of 32 (rows of 16 bytes), and [its e4m3 factors per 1x16 block (a 16x16
    tile's factor repeated over its 16 rows) swizzled SWIZZLE_32_4_4, the tensor factor]."""
    rows = q.shape[0]
    data = F.pad(q.packed, (0, -q.packed.shape[1] % 16)).contiguous().view(FLOAT4)
    factors = q.block_inv_scale.view(torch.uint8)
    if q.block[0] > 1:
        factors = factors[:, None, :].expand(-1, q.block[0], -1).reshape(-1, factors.shape[1])
    factors = swizzle_32_4_4(factors[:rows].view(E4M3))
    return data, [factors, q.tensor_inv_scale.reshape(()).to(data.device, torch.float32)]


@dataclass(frozen=True, eq=False)
class GemmOperand:
    """An NVFP4 (R, K) as the right operand of the CUDA FP4 GEMM takes it (`_cuda_operand`'s
    layout), built once and taken as it is by each GEMM (`prepared_mm`): `data` the codes as
    float4_e2m1fn_x2 with K zero-padded to a multiple of 32, `block_factors` the e4m3 factors
    per 1x16 block swizzled SWIZZLE_32_4_4, `tensor_factor` the 0-d float32 factor."""

    data: torch.Tensor
    block_factors: torch.Tensor
    tensor_factor: torch.Tensor
    shape: torch.Size  # (R, K), as quantized


def gemm_operand_parts(
    q: NVFP4, *, transpose: bool = False, out: tuple | None = None
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]:
    """(codes, swizzled factors) of `q` (R, K), or with `transpose` of its transpose (K, R):
    a weight's operand of the grad_input GEMM, its 16x16 tiles transposed exactly
    (`transposed`). Written into `out`'s buffers when given (a previous build's), else into
    new ones: ((codes, factors), buffers newly allocated). Codes that need neither padding
    nor transposition are `q.packed` itself, viewed as float4_e2m1fn_x2."""
    src = transposed(q) if transpose else q
    data, (factors, _) = _cuda_operand(src)
    old_codes, old_factors = (None, None) if out is None else out
    new: list[torch.Tensor] = []
    if not transpose and q.packed.shape[1] % 16 == 0 and q.packed.is_contiguous():
        codes = q.packed  # the same bytes as they are: no copy
    else:
        codes = _own(
            data.view(torch.uint8), None if old_codes is None else old_codes.view(torch.uint8)
        )
        new += [codes] if old_codes is None else []
    factors = _own(factors, old_factors)
    new += [factors] if old_factors is None else []
    return (codes.view(FLOAT4), factors), tuple(new)


def _own(t: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`t` in a buffer of its own spanning its whole storage (`t` itself when it is one),
    or copied into `out`."""
    if out is not None:
        return out.view(t.dtype).copy_(t)
    whole = t.storage_offset() == 0 and t.numel() * t.itemsize == t.untyped_storage().nbytes()
    return t if whole and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


def gemm_operand(q: NVFP4, parts: tuple[torch.Tensor, torch.Tensor], *, transpose: bool = False):
    """The `GemmOperand` of `q` (or of its transpose) from its `gemm_operand_parts`."""
    rows, k = q.shape
    shape = torch.Size((k, rows) if transpose else (rows, k))
    return GemmOperand(parts[0], parts[1], q.tensor_inv_scale.reshape(()), shape)


def nvfp4_mm(
    a: NVFP4, b: NVFP4, out_dtype: torch.dtype = torch.float32, *, emulate: bool = False
) -> torch.Tensor:
    """`emulated_mm`'s product. On CUDA SM100+ one cuBLAS FP4 GEMM (`F.scaled_mm`, scales
    [BlockWise1x16, TensorWise] per operand); on CPU (which has no FP4 GEMM) and with
    `emulate`, the emulated GEMM; on a CUDA device below SM100 a ValueError."""
    device = a.packed.device
    if emulate or device.type != "cuda":
        return emulated_mm(a, b, out_dtype)  # which checks the operands
    _check_mm(a, b)
    check_nvfp4_gemm_device(device, emulate=False)
    return _cuda_mm(_cuda_operand(a), _cuda_operand(b), out_dtype)


def prepared_mm(a: NVFP4, b: GemmOperand, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`nvfp4_mm(a, b)` on CUDA SM100+ with b's operand built beforehand (`GemmOperand`):
    the same GEMM, b taken as it is (no padding, expansion or swizzle of b here)."""
    if len(a.shape) != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(
            f"an NVFP4 GEMM takes a (M, K) and b (N, K) with the same K, got {tuple(a.shape)} "
            f"and {tuple(b.shape)}; build b's operand from the right quantized tensor"
        )
    device = a.packed.device
    if device.type != "cuda":
        raise ValueError(f"prepared_mm runs the CUDA FP4 GEMM; a is on {device}: use nvfp4_mm")
    check_nvfp4_gemm_device(device, emulate=False)
    return _cuda_mm(_cuda_operand(a), (b.data, [b.block_factors, b.tensor_factor]), out_dtype)


def _cuda_mm(
    operand_a: tuple[torch.Tensor, list[torch.Tensor]],
    operand_b: tuple[torch.Tensor, list[torch.Tensor]],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    (data_a, scales_a), (data_b, scales_b) = operand_a, operand_b
    st, sw = F.ScalingType, F.SwizzleType
    recipe, swizzle = [st.BlockWise1x16, st.TensorWise], [sw.SWIZZLE_32_4_4, sw.NO_SWIZZLE]
    native = out_dtype if out_dtype in (torch.bfloat16, torch.float16) else torch.float32
    out = scaled_mm_v2(
        data_a, data_b.t(), scales_a, recipe, scales_b, recipe, swizzle, swizzle,
        output_dtype=native,
    )  # fmt: skip
    return out.to(out_dtype)
