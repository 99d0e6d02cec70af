"""The float8 GEMM on plain data and scales: `scaled_mm_data`, and what it needs.

Mental model: a (M, K) @ b (K, N) of float8 data, each operand with its `scale` (which
multiplies hp into float8, `fsdp_float8.core.float8_tensor`): 0-d (tensorwise), or one per
row of a (M, 1) and per column of b (1, N) (rowwise, along the contraction dim). The GEMM
lays a out row-major and b column-major (what hardware GEMMs need), pads K and N to
multiples of 16 when asked, and runs one of:
- the emulation: dequantize to float32, one float32 matmul, rounded once to out_dtype;
- CUDA `torch._scaled_mm`; with row scales and an output that is not bfloat16 (which its
  row-scaled kernel does not write) a unit-scale GEMM in float32 with the scales around it
  (a CPU test takes the same route inside `cuda_gemm_rules_on_cpu`);
- CPU `torch._scaled_mm` through one custom op, `cpu_scaled_mm`, that adapts the CUDA
  contract to what this torch's CPU kernel takes (`fsdp_float8.core._compat`).
Block-scaled operands go to `fsdp_float8.core.blocks.block_scaled_mm`. It takes plain
tensors, so the linear layer's autograd function traces under torch.compile without building
subclasses inside the graph; `fsdp_float8.core.float8_ops.scaled_mm` is the same GEMM on two
Float8Tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from fsdp_float8.core import _compat
from fsdp_float8.core._compat import cpu_scaled_mm_takes_row_scales
from fsdp_float8.core.blocks import Block, block_scaled_mm


def check_gemm_scales(
    gemm: str,
    a_scale: torch.Tensor,
    a_shape: tuple[int, ...],
    b_scale: torch.Tensor,
    b_shape: tuple[int, ...],
) -> None:
    """Refuse scales that are neither 0-d (tensorwise) nor of the shape that scales each
    operand along the GEMM's contraction dim (`a_shape`, `b_shape`): any other shape would
    broadcast into a wrong product, or fail deep inside a kernel."""
    got_a, got_b = tuple(a_scale.shape), tuple(b_scale.shape)
    if got_a not in ((), a_shape) or got_b not in ((), b_shape):
        raise ValueError(
            f"{gemm} needs a's scale 0-d or of shape {a_shape} and b's 0-d or of shape "
            f"{b_shape}, got {got_a} and {got_b}: each operand must be scaled as a whole or "
            "along the GEMM's contraction dim (per row of a, per column of b)"
        )


def row_and_column_major(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a row-major and b column-major in their last two dims (copies only when needed):
    the layouts a hardware float8 GEMM takes, and the ones every backend here multiplies."""
    a = a if a.is_contiguous() else a.contiguous()
    if not b.transpose(-2, -1).is_contiguous():
        b = b.transpose(-2, -1).contiguous().transpose(-2, -1)
    return a, b


def _gemm_scales(
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    m: int,
    n: int,
    known: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> tuple[torch.Tensor, torch.Tensor]:
    """inv_scales shaped as torch._scaled_mm wants: both 0-d, or (M, 1) and (1, N). One op
    per operand: a reciprocal (of the expanded scale where one operand is tensorwise and
    the other not: it writes a fresh dense tensor, and torch._scaled_mm rejects the stride 0
    of an expanded one). `known`: an operand's `1 / scale` made by the caller (no op), used
    where it has that shape already (0-d, or one value per row or column)."""
    known_a, known_b = known
    if a_scale.numel() == 1 and b_scale.numel() == 1:
        inv_a = a_scale.reshape(()).reciprocal() if known_a is None else known_a
        inv_b = b_scale.reshape(()).reciprocal() if known_b is None else known_b
        return inv_a, inv_b
    if a_scale.shape not in ((), (m, 1)) or b_scale.shape not in ((), (1, n)):
        check_gemm_scales("scaled_mm", a_scale, (m, 1), b_scale, (1, n))  # it raises
    if known_a is not None and known_a.numel() == m == a_scale.numel():
        inv_a = known_a.reshape(m, 1)
    else:
        inv_a = a_scale.reshape(-1, 1).expand(m, 1).reciprocal()
    if known_b is not None and known_b.numel() == n == b_scale.numel():
        inv_b = known_b.reshape(1, n)
    else:
        inv_b = b_scale.reshape(1, -1).expand(1, n).reciprocal()
    return inv_a, inv_b


def _dense(scale: torch.Tensor) -> torch.Tensor:
    """A fresh row-major copy: `contiguous()` keeps the stride 0 of an expanded size-1 or
    size-0 dim (M = 1 or 0 tokens), which torch._scaled_mm rejects."""
    return scale.clone(memory_format=torch.contiguous_format)


def _pad_rows(data: torch.Tensor, pad: int, dim: int) -> torch.Tensor:
    # float8 zero is the all-zero byte, so pad the uint8 view.
    as_bytes = data.view(torch.uint8)
    padding = (0, pad) if dim == 1 else (0, 0, 0, pad)
    return F.pad(as_bytes, padding).view(data.dtype)


def _cpu_scaled_mm(
    a_data: torch.Tensor,
    b_data: torch.Tensor,
    inv_a: torch.Tensor,
    inv_b: torch.Tensor,
    out_dtype: torch.dtype,
    use_fast_accum: bool,
) -> torch.Tensor:
    """CPU `torch._scaled_mm` with the CUDA kernel's contract (0-d or row/column inverse
    scales), adapted to what this torch's CPU kernel takes (fsdp_float8.core._compat).

    With row scales (torch 2.13+): 0-d scales go in as (M, 1) and (1, N), because 0-d scales
    of same-dtype operands take a oneDNN kernel ~300x slower than the per-row path (2.13);
    the two agree to float32 rounding. Without (2.11: 0-d only), row scales are applied
    around a GEMM with unit scales: `out = inv_a * (a_data @ b_data) * inv_b` in float32,
    rounded once to out_dtype. Scales commute with the sum over K, so this is the dequantized
    product: equal to the native row-scale path when the scales are powers of two, to float32
    rounding otherwise (tests/unit/test_scaling.py checks both against the native path).

    One op (a torch.library custom op), so these CPU-only adaptations stay inside the GEMM,
    as they are inside a CUDA GEMM: torch.compile calls it as it calls `torch._scaled_mm`,
    and the graph around it is the one a GPU gets (`f8train/count_kernels.py` opens it).
    """
    with torch.autocast("cpu", enabled=False):  # as the CUDA GEMM: autocast leaves it
        return _cpu_scaled_mm_here(a_data, b_data, inv_a, inv_b, out_dtype, use_fast_accum)


def _cpu_scaled_mm_here(a_data, b_data, inv_a, inv_b, out_dtype, use_fast_accum):
    scalar_scales = inv_a.dim() == 0 and inv_b.dim() == 0
    row_scales = _compat._ROW_SCALES  # probed once (the call below probes at first use)
    if row_scales is None:
        row_scales = cpu_scaled_mm_takes_row_scales()
    if row_scales:
        if scalar_scales:  # `_dense`, twice
            dense = torch.contiguous_format
            inv_a = inv_a.expand(a_data.shape[0], 1).clone(memory_format=dense)
            inv_b = inv_b.expand(1, b_data.shape[1]).clone(memory_format=dense)
    elif not scalar_scales:
        return row_scaled_mm_around_unit_gemm(a_data, b_data, inv_a, inv_b, out_dtype)
    return torch._scaled_mm(
        a_data, b_data, inv_a, inv_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum
    )


cpu_scaled_mm = torch.library.custom_op("fsdp_float8::cpu_scaled_mm", mutates_args=())(
    _cpu_scaled_mm
)


@cpu_scaled_mm.register_fake
def _cpu_scaled_mm_fake(a_data, b_data, inv_a, inv_b, out_dtype, use_fast_accum):
    return a_data.new_empty((a_data.shape[0], b_data.shape[1]), dtype=out_dtype)


def _mm_outside_autocast(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    with torch.autocast(a.device.type, enabled=False):
        if a.dtype == b.dtype == out_dtype:
            return torch.mm(a, b)
        if a.is_cuda and a.dtype == b.dtype and a.dtype.itemsize == 2 and out_dtype.itemsize == 4:
            # 16-bit operands, float32 accumulation and result: no float32 copies of them
            return torch.mm(a, b, out_dtype=out_dtype)
        return torch.mm(a.to(out_dtype), b.to(out_dtype))


# one op, opaque to autocast and to tracing: the context inside it is never traced
mm_outside_autocast = torch.library.custom_op("fsdp_float8::mm_outside_autocast", mutates_args=())(
    _mm_outside_autocast
)


@mm_outside_autocast.register_fake
def _mm_outside_autocast_fake(a, b, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def high_precision_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`a @ b` with a result in `out_dtype` (float32 for a float32 weight's gradient),
    whatever autocast says: a float8 layer's high-precision GEMM (rowwise_with_gw_hp's
    grad_weight, the emulation's) must not depend on whether `.backward()` runs inside the
    forward's autocast region, nor on tracing (torch.compile traces a backward under the
    forward's autocast). A float32 result, or any under autocast, comes from
    `mm_outside_autocast`; otherwise it is `torch.mm` in `out_dtype` (which autocast, off,
    leaves as it is)."""
    if out_dtype == torch.float32 or torch.is_autocast_enabled(a.device.type):
        return mm_outside_autocast(a, b, out_dtype)
    return torch.mm(a.to(out_dtype), b.to(out_dtype))


def row_scaled_mm_around_unit_gemm(
    a_data: torch.Tensor,
    b_data: torch.Tensor,
    inv_a: torch.Tensor,
    inv_b: torch.Tensor,
    out_dtype: torch.dtype,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """Row-scaled float8 GEMM from a tensorwise GEMM with unit scales and a float32 result:
    `inv_a * (a_data @ b_data) * inv_b`, rounded once to `out_dtype`. The scales commute
    with the sum over K, so this is the row-scaled product, where a kernel takes no row
    scales (CPU on torch 2.11, `cpu_scaled_mm`) or gives no `out_dtype` with them (CUDA's
    row-scaled kernel writes bfloat16 only: a float32 or float16 layer's GEMMs)."""
    one = torch.ones((), dtype=torch.float32, device=a_data.device)
    out = torch._scaled_mm(
        a_data, b_data, one, one, out_dtype=torch.float32, use_fast_accum=use_fast_accum
    )
    return (out * inv_a * inv_b).to(out_dtype)


def scaled_mm_data(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    emulate: bool = False,
    use_fast_accum: bool = False,
    pad_inner_dim: bool = False,
    blocks: tuple[Block | None, Block | None] = (None, None),
    scale_dtype: torch.dtype = torch.float32,
    inv_scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> torch.Tensor:
    """a (M, K) @ b (K, N) from float8 data and scales (`scale` multiplies hp into fp8).
    Lays out a row-major and b column-major (what the hardware GEMM needs), pads K and N to
    multiples of 16 when asked (`_pad_to_16`), and either calls `torch._scaled_mm` or
    emulates it in float32. Takes plain tensors so the linear layer's autograd function
    traces under torch.compile without building subclasses inside the graph.
    `blocks`: each operand's (rows, cols) block when block-scaled: then the block GEMM
    (`fsdp_float8.core.blocks.block_scaled_mm`, with `scale_dtype` float32 or e8m0) runs.
    `inv_scales`: each operand's `1 / scale`, when the caller has it already (one operand's
    scale serving two GEMMs; a gathered weight's, made with its all-gather), else None."""
    if blocks != (None, None):
        return block_scaled_mm(
            a_data, a_scale, blocks[0], b_data, b_scale, blocks[1], out_dtype=out_dtype,
            emulate=emulate, use_fast_accum=use_fast_accum, scale_dtype=scale_dtype,
        )  # fmt: skip
    n = b_data.shape[1]
    inv_a, inv_b = inv_scales
    if inv_a is None or inv_b is None or inv_a.dim() or inv_b.dim():  # else both 0-d, known
        inv_a, inv_b = _gemm_scales(a_scale, b_scale, a_data.shape[0], n, inv_scales)
    cuda = not emulate and a_data.is_cuda
    # `row_and_column_major`, inline (one call fewer per GEMM); on CUDA a column-major b
    # with a wider leading dimension is taken as it is (`_strided_columns`)
    a_data = a_data if a_data.is_contiguous() else a_data.contiguous()
    if not b_data.transpose(-2, -1).is_contiguous() and not (cuda and _strided_columns(b_data)):
        b_data = b_data.transpose(-2, -1).contiguous().transpose(-2, -1)
    if a_data.shape[1] % 16 or n % 16:  # else `_pad_to_16` has nothing to do
        a_data, b_data, inv_b = _pad_to_16(a_data, b_data, inv_b, pad_inner_dim, cuda)
    out = _laid_out_mm(a_data, b_data, inv_a, inv_b, out_dtype, emulate, use_fast_accum)
    return out if out.shape[1] == n else out[:, :n].contiguous()  # cut N's padding


def _laid_out_mm(
    a_data: torch.Tensor,
    b_data: torch.Tensor,
    inv_a: torch.Tensor,
    inv_b: torch.Tensor,
    out_dtype: torch.dtype,
    emulate: bool,
    use_fast_accum: bool,
) -> torch.Tensor:
    """The backend's GEMM on operands `scaled_mm_data` has laid out and padded, with inverse
    scales in torch._scaled_mm's shapes: the float32 emulation, the unit-scale GEMM with the
    row scales around it, CPU `cpu_scaled_mm`, or CUDA `torch._scaled_mm`."""
    if emulate:
        dequantized = (a_data.to(torch.float32) * inv_a, b_data.to(torch.float32) * inv_b)
        return high_precision_mm(*dequantized, torch.float32).to(out_dtype)
    if (
        inv_a.dim() > 0 and out_dtype != torch.bfloat16 and (a_data.is_cuda or _CUDA_RULES_ON_CPU)
    ):  # CUDA's row-scaled kernel writes bfloat16 only: the scales go around the GEMM
        return row_scaled_mm_around_unit_gemm(
            a_data, b_data, inv_a, inv_b, out_dtype, use_fast_accum
        )
    if a_data.device.type == "cpu":  # what this torch's CPU kernel takes: _compat
        return cpu_scaled_mm(a_data, b_data, inv_a, inv_b, out_dtype, use_fast_accum)
    return torch._scaled_mm(
        a_data, b_data, inv_a, inv_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum
    )


def _strided_columns(b: torch.Tensor) -> bool:
    """Whether `b` (K, N) is column-major as cuBLASLt reads it without a copy: unit stride
    down each column, columns at least K apart and 16 bytes aligned (a view of a wider
    transposed buffer, `formats.tensorwise.joint_columns`, whose offsets are multiples of
    16 bytes)."""
    return (
        b.dim() == 2
        and b.stride(0) == 1
        and b.stride(1) >= max(1, b.shape[0])
        and b.stride(1) * b.element_size() % 16 == 0
    )


def _pad_to_16(a_data, b_data, inv_b, pad_inner_dim: bool, cuda: bool):
    """CUDA torch._scaled_mm needs K and N (both dims of b) to be multiples of 16. With
    `pad_inner_dim`, zero-pad K in both operands (adds nothing to the sum) and N with zero
    columns of b (scale 1; the caller cuts them off the output); without it, refuse on
    CUDA (CPU and emulation take any shape)."""
    k, n = a_data.shape[1], b_data.shape[1]
    if k % 16 == 0 and n % 16 == 0:
        return a_data, b_data, inv_b
    if not pad_inner_dim:
        if cuda:
            raise ValueError(
                f"float8 GEMM with K={k}, N={n}: torch._scaled_mm on CUDA needs both to be "
                "multiples of 16; set Float8LinearConfig(pad_inner_dim=True) (pads them "
                "with zeros) or use a layer whose dims are multiples of 16"
            )
        return a_data, b_data, inv_b
    if k % 16:
        a_data = _pad_rows(a_data, -k % 16, dim=1)
        b_data = _pad_rows(b_data.t(), -k % 16, dim=1).t()
    if n % 16:
        b_data = _pad_rows(b_data.t(), -n % 16, dim=0).t()
        if inv_b.dim() == 2:
            inv_b = F.pad(inv_b, (0, -n % 16), value=1.0)
    return a_data, b_data, inv_b


_CUDA_RULES_ON_CPU = False


@contextlib.contextmanager
def cuda_gemm_rules_on_cpu() -> Iterator[None]:
    """Inside, CPU float8 GEMMs (not emulated) take the route a CUDA GEMM takes where CUDA
    `torch._scaled_mm` has a rule the CPU kernel lacks: a row-scaled GEMM whose output is
    not bfloat16 runs as a unit-scale GEMM with the scales around it
    (`row_scaled_mm_around_unit_gemm`), so a CPU test sees the calls a GPU gets. Off by
    default: the CPU kernel itself takes any output dtype."""
    global _CUDA_RULES_ON_CPU
    before, _CUDA_RULES_ON_CPU = _CUDA_RULES_ON_CPU, True
    try:
        yield
    finally:
        _CUDA_RULES_ON_CPU = before


def check_float8_gemm_device(device: torch.device, *, emulate: bool) -> None:
    """At convert time: refuse a CUDA device without float8 GEMMs (compute capability
    below 8.9). A meta-device model is judged by the current CUDA device, if any."""
    if emulate or torch.version.hip is not None:
        return
    if device.type == "meta" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"float8 GEMMs need a CUDA device of compute capability 8.9 or higher (Ada, "
            f"Hopper, Blackwell); {device} has {major}.{minor}. Set "
            "Float8LinearConfig(emulate=True) to run the same float8 numerics in float32 "
            "emulation, or keep the model in bf16 on this device"
        )
