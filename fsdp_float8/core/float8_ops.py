"""Ops on Float8Tensor: one table filled by `@implements`, and `scaled_mm`.

Mental model: a Float8Tensor is (data, scale). Shape ops apply to the data and move the
scale along (a 0-d tensorwise scale stays as is; an axiswise scale, which has the data's
rank with size 1 on the reduced dim, is transposed/sliced/reshaped with it). Matmuls go
through `scaled_mm`, which is either `torch._scaled_mm` or its high-precision emulation;
block-scaled operands (`Float8Tensor._block`) go to the block GEMM beside it
(`fsdp_float8.core.blocks.block_scaled_mm`), and shape ops that would cut blocks refuse.
Any op not in the table raises, naming the op: we never silently dequantize.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from fsdp_float8.core._compat import cpu_scaled_mm_takes_row_scales
from fsdp_float8.core.blocks import Block, block_scaled_mm
from fsdp_float8.core.float8_tensor import Float8Tensor

aten = torch.ops.aten
FLOAT8_OPS: dict[object, Callable] = {}


def implements(*ops):
    def decorator(fn):
        for op in ops:
            if op in FLOAT8_OPS:
                raise RuntimeError(f"{op} already has a Float8Tensor implementation")
            FLOAT8_OPS[op] = fn
        return fn

    return decorator


def _rewrap(t: Float8Tensor, data: torch.Tensor, scale: torch.Tensor | None = None, block=None):
    scale = t._scale if scale is None else scale
    return Float8Tensor(data, scale, t._orig_dtype, t._emulate, block or t._block)


def _refuse_blocks(t: Float8Tensor, what: str) -> None:
    if t._block is not None:
        raise ValueError(
            f"{what} of a block-scaled Float8Tensor (block {t._block}, scale "
            f"{tuple(t._scale.shape)}) is not supported: it would cut blocks; dequantize first"
        )


def _tensorwise(t: Float8Tensor) -> bool:
    return t._scale.numel() == 1 and t._scale.dim() == 0


@implements(aten.detach.default, aten.alias.default)
def _detach(func, args, kwargs):
    t = args[0]
    return _rewrap(t, func(t._data), func(t._scale))


@implements(aten.clone.default)
def _clone(func, args, kwargs):
    t = args[0]
    return _rewrap(t, func(t._data, **kwargs), t._scale.clone())


@implements(aten.t.default, aten.transpose.int)
def _transpose(func, args, kwargs):
    t = args[0]
    if _tensorwise(t):
        return _rewrap(t, func(t._data, *args[1:]))
    block = None if t._block is None else (t._block[1], t._block[0])  # 2-D: swap
    return _rewrap(t, func(t._data, *args[1:]), func(t._scale, *args[1:]), block)


@implements(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(func, args, kwargs):
    t, shape = args[0], list(args[1])
    if t._block is not None and shape == list(t.shape):
        return _rewrap(t, func(t._data, shape))
    _refuse_blocks(t, f"view as {shape}")
    data = func(t._data, shape)
    if _tensorwise(t):
        return _rewrap(t, data)
    new_shape, scale = list(data.shape), t._scale
    if scale.shape[-1] == 1 and new_shape[-1] == t._data.shape[-1]:
        return _rewrap(t, data, scale.reshape(new_shape[:-1] + [1]))
    if scale.numel() == scale.shape[-1] and new_shape[-1] == t._data.shape[-1]:
        return _rewrap(t, data, scale.reshape([1] * (len(new_shape) - 1) + [scale.shape[-1]]))
    raise ValueError(
        f"cannot view an axiswise Float8Tensor of shape {tuple(t.shape)} (scale "
        f"{tuple(scale.shape)}) as {shape}: only views that keep the last dim move the "
        "scale along; dequantize first"
    )


def _slice_scale(t: Float8Tensor, dim: int, start, end, step=1) -> torch.Tensor:
    _refuse_blocks(t, "slicing")
    if _tensorwise(t) or t._scale.shape[dim] == 1:
        return t._scale
    return aten.slice.Tensor(t._scale, dim, start, end, step)


@implements(aten.slice.Tensor)
def _slice(func, args, kwargs):
    t, dim = args[0], (args[1] if len(args) > 1 else 0)
    start = args[2] if len(args) > 2 else None
    end = args[3] if len(args) > 3 else None
    step = args[4] if len(args) > 4 else 1
    return _rewrap(t, func(*((t._data,) + tuple(args[1:]))), _slice_scale(t, dim, start, end, step))


@implements(aten.split.Tensor, aten.split_with_sizes.default)
def _split(func, args, kwargs):
    t = args[0]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    chunks = func(t._data, *args[1:], **kwargs)
    out, start = [], 0
    for c in chunks:
        size = c.shape[dim]
        out.append(_rewrap(t, c, _slice_scale(t, dim, start, start + size)))
        start += size
    return out


@implements(aten.as_strided.default)
def _as_strided(func, args, kwargs):
    # FSDP2 calls this on the all-gathered weight to cut the padding of uneven shards.
    t, size = args[0], list(args[1])
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    scale = t._scale
    # per row: (rows, 1), or (E, out, 1) for a 3-D expert weight
    per_row = scale.dim() == t._data.dim() >= 2 and scale.shape[-1] == 1
    if (per_row or t._block is not None) and size == list(t.shape) and not offset:
        # nothing to cut: keep the data's strides (the rowwise and block all-gather outputs
        # have the scales' bytes between rows, so the data is not contiguous)
        return _rewrap(t, t._data)
    _refuse_blocks(t, f"as_strided to {size}")
    data = func(t._data, *args[1:], **kwargs)
    if _tensorwise(t):
        return _rewrap(t, data)
    if per_row and t._data.is_contiguous():
        return _rewrap(t, data, scale[: size[0]])
    raise ValueError(
        f"as_strided on an axiswise Float8Tensor with scale {tuple(scale.shape)} is only "
        "supported for per-row scales of a contiguous tensor"
    )


@implements(aten.cat.default)
def _cat(func, args, kwargs):
    tensors = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    first = tensors[0]
    if not all(isinstance(x, Float8Tensor) for x in tensors):
        raise TypeError("cat of Float8Tensor with plain tensors; dequantize first")
    for x in tensors:
        _refuse_blocks(x, "cat")
    # tensorwise, or axiswise along the reduced dim (scale size 1 there): one scale covers
    # the result, so the pieces must share it
    shared = all(_tensorwise(x) for x in tensors) or all(
        x._scale.dim() > 0 and x._scale.shape[dim] == 1 for x in tensors
    )
    if shared:
        if any(x._scale is not first._scale for x in tensors[1:]):
            raise ValueError(
                f"cat along dim {dim} of Float8Tensors with different scale tensors (shapes "
                f"{[tuple(x._scale.shape) for x in tensors]}) would mix scales; rescale to "
                "one scale first"
            )
        return _rewrap(first, func([x._data for x in tensors], dim))
    scale = func([x._scale for x in tensors], dim)
    return _rewrap(first, func([x._data for x in tensors], dim), scale)


@implements(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    t = args[0]
    dtype = kwargs.pop("dtype", None)
    if dtype is not None and dtype.is_floating_point and dtype.itemsize == 1:
        raise TypeError(f"cannot .to({dtype}) a Float8Tensor; its data already is float8")
    data = func(t._data, **kwargs)
    scale = func(t._scale, **kwargs)
    return Float8Tensor(data, scale, dtype or t._orig_dtype, t._emulate, t._block)


@implements(aten.copy_.default)
def _copy(func, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(dst, Float8Tensor) and isinstance(src, Float8Tensor):
        dst._data.copy_(src._data)
        dst._scale.copy_(src._scale)
        return dst
    if isinstance(src, Float8Tensor):
        return dst.copy_(src.dequantize())
    raise TypeError(
        "copying high-precision values into a Float8Tensor would need a scale; "
        "build a new Float8Tensor with hp_to_float8 instead"
    )


@implements(aten.is_same_size.default)
def _is_same_size(func, args, kwargs):
    return args[0].shape == args[1].shape


@implements(aten.mm.default)
def _mm(func, args, kwargs):
    a, b = args
    _require_float8(a, b, "mm")
    return scaled_mm(a, b, out_dtype=a._orig_dtype, emulate=a._emulate)


@implements(aten.addmm.default)
def _addmm(func, args, kwargs):
    bias, a, b = args
    _require_float8(a, b, "addmm")
    out = scaled_mm(a, b, out_dtype=a._orig_dtype, emulate=a._emulate)
    return out + bias.to(out.dtype)


def _require_float8(a, b, name: str) -> None:
    if not (isinstance(a, Float8Tensor) and isinstance(b, Float8Tensor)):
        raise TypeError(
            f"{name} needs both operands as Float8Tensor, got {type(a).__name__} and "
            f"{type(b).__name__}; cast the other operand with hp_to_float8"
        )


def _gemm_scales(
    a_scale: torch.Tensor, b_scale: torch.Tensor, m: int, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """inv_scales shaped as torch._scaled_mm wants: both 0-d, or (M, 1) and (1, N). One op
    per operand: a reciprocal (of the expanded scale where one operand is tensorwise and
    the other not: it writes a fresh dense tensor, and torch._scaled_mm rejects the stride 0
    of an expanded one)."""
    if a_scale.numel() == 1 and b_scale.numel() == 1:
        return a_scale.reshape(()).reciprocal(), b_scale.reshape(()).reciprocal()
    a_shape, b_shape = tuple(a_scale.shape), tuple(b_scale.shape)
    if not (a_shape in ((m, 1), ()) and b_shape in ((1, n), ())):
        raise ValueError(
            f"scaled_mm needs a's scale per row (shape ({m}, 1)) and b's per column "
            f"(shape (1, {n})), got {a_shape} and {b_shape}: each "
            "operand must be scaled along the GEMM's contraction dim"
        )
    inv_a = a_scale.reshape(-1, 1).expand(m, 1).reciprocal()
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
    tensorwise = inv_a.dim() == 0 and inv_b.dim() == 0
    if cpu_scaled_mm_takes_row_scales():
        if tensorwise:
            inv_a = _dense(inv_a.expand(a_data.shape[0], 1))
            inv_b = _dense(inv_b.expand(1, b_data.shape[1]))
    elif not tensorwise:
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


def row_scaled_mm_around_unit_gemm(
    a_data: torch.Tensor,
    b_data: torch.Tensor,
    inv_a: torch.Tensor,
    inv_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Row-scaled float8 GEMM from a tensorwise GEMM with unit scales (see `cpu_scaled_mm`)."""
    one = torch.ones((), dtype=torch.float32, device=a_data.device)
    out = torch._scaled_mm(a_data, b_data, one, one, out_dtype=torch.float32)
    return (out * inv_a * inv_b).to(out_dtype)


def scaled_mm(
    a: Float8Tensor,
    b: Float8Tensor,
    *,
    out_dtype: torch.dtype,
    emulate: bool = False,
    use_fast_accum: bool = False,
    pad_inner_dim: bool = False,
) -> torch.Tensor:
    """a (M, K) @ b (K, N) from two Float8Tensors (see `scaled_mm_data`)."""
    return scaled_mm_data(
        a._data,
        a._scale,
        b._data,
        b._scale,
        out_dtype=out_dtype,
        emulate=emulate,
        use_fast_accum=use_fast_accum,
        pad_inner_dim=pad_inner_dim,
        blocks=(a._block, b._block),
    )


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
) -> torch.Tensor:
    """a (M, K) @ b (K, N) from float8 data and scales (`scale` multiplies hp into fp8).
    Lays out a row-major and b column-major (what the hardware GEMM needs), pads K and N to
    multiples of 16 when asked (`_pad_to_16`), and either calls `torch._scaled_mm` or
    emulates it in float32. Takes plain tensors so the linear layer's autograd function
    traces under torch.compile without building subclasses inside the graph.
    `blocks`: each operand's (rows, cols) block when block-scaled: then the block GEMM
    (`fsdp_float8.core.blocks.block_scaled_mm`, with `scale_dtype` float32 or e8m0) runs."""
    if blocks != (None, None):
        return block_scaled_mm(
            a_data, a_scale, blocks[0], b_data, b_scale, blocks[1], out_dtype=out_dtype,
            emulate=emulate, use_fast_accum=use_fast_accum, scale_dtype=scale_dtype,
        )  # fmt: skip
    n = b_data.shape[1]
    inv_a, inv_b = _gemm_scales(a_scale, b_scale, a_data.shape[0], n)
    a_data = a_data if a_data.is_contiguous() else a_data.contiguous()
    b_data = b_data if b_data.t().is_contiguous() else b_data.t().contiguous().t()
    cuda = not emulate and a_data.is_cuda
    a_data, b_data, inv_b = _pad_to_16(a_data, b_data, inv_b, pad_inner_dim, cuda)
    if emulate:
        out = (a_data.to(torch.float32) * inv_a) @ (b_data.to(torch.float32) * inv_b)
        out = out.to(out_dtype)
    else:
        check_gemm_supported(a_data.device.type, rowwise=inv_a.dim() > 0, out_dtype=out_dtype)
        if a_data.device.type == "cpu":  # what this torch's CPU kernel takes: _compat
            out = cpu_scaled_mm(a_data, b_data, inv_a, inv_b, out_dtype, use_fast_accum)
        else:
            out = torch._scaled_mm(
                a_data, b_data, inv_a, inv_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum
            )
    return out if out.shape[1] == n else out[:, :n].contiguous()  # cut N's padding


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
    """Inside, CPU float8 GEMMs (not emulated) refuse what CUDA `torch._scaled_mm` refuses
    (`check_gemm_supported`), so a CPU test sees a call that would fail on a GPU. Off by
    default: the CPU kernel itself takes any output dtype, and CPU runs use it in float32."""
    global _CUDA_RULES_ON_CPU
    before, _CUDA_RULES_ON_CPU = _CUDA_RULES_ON_CPU, True
    try:
        yield
    finally:
        _CUDA_RULES_ON_CPU = before


def check_gemm_supported(device_type: str, *, rowwise: bool, out_dtype: torch.dtype) -> None:
    """Refuse a float8 GEMM that CUDA torch._scaled_mm cannot run: row-wise scales give a
    bfloat16 output only. Always on CUDA; on CPU inside `cuda_gemm_rules_on_cpu()`."""
    enforced = device_type == "cuda" or (device_type == "cpu" and _CUDA_RULES_ON_CPU)
    if enforced and rowwise and out_dtype != torch.bfloat16:
        raise ValueError(
            f"a rowwise-scaled float8 GEMM on CUDA asks for a {out_dtype} output, but "
            "torch._scaled_mm with row-wise scales produces bfloat16 only; train with "
            "bfloat16 parameters and activations (FSDP2 MixedPrecisionPolicy(param_dtype="
            "torch.bfloat16), torch.autocast, or model.to(torch.bfloat16)), or use the "
            "'tensorwise' recipe, or Float8LinearConfig(emulate=True)"
        )


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
