"""Ops on Float8Tensor: one table filled by `@implements`, and `scaled_mm`.

Mental model: a Float8Tensor is (data, scale). Shape ops apply to the data and move the
scale along (a 0-d tensorwise scale stays as is; an axiswise scale, which has the data's
rank with size 1 on the reduced dim, is transposed/sliced/reshaped with it). Matmuls go
through `scaled_mm`, which is either `torch._scaled_mm` or its high-precision emulation;
block-scaled operands (`Float8Tensor._block`) go to the block GEMM
(`fsdp_float8.core.blocks.block_scaled_mm`), and shape ops that would cut blocks refuse.
Any op not in the table raises, naming the op: we never silently dequantize.
The GEMM on plain data and scales, and its CPU and CUDA rules, live in
`fsdp_float8.core.gemm`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fsdp_float8.core.float8_tensor import Float8Tensor
from fsdp_float8.core.gemm import scaled_mm_data

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


def _one_scale(t: Float8Tensor) -> bool:
    return t._scale.numel() == 1 and t._scale.dim() == 0


@implements(aten.detach.default, aten.alias.default)
def _detach(func, args, kwargs):
    t = args[0]
    return _same_weight(t, _rewrap(t, func(t._data), func(t._scale)))


def _same_weight(t: Float8Tensor, new: Float8Tensor, rows: int | None = None) -> Float8Tensor:
    """`new` is the same weight as `t` (FSDP2 makes its unsharded parameter so: as_strided,
    which may cut padding rows, then detach): it keeps `t`'s once-per-unshard operands, and
    its scales' inverses (per row: the first `rows` of them when rows were cut)."""
    inverse = t._inverse
    if rows is not None and inverse is not None and inverse.dim() > 0:
        inverse = inverse[:rows]
    new._operands, new._inverse = t._operands, inverse
    return new


@implements(aten.clone.default)
def _clone(func, args, kwargs):
    t = args[0]
    return _rewrap(t, func(t._data, **kwargs), t._scale.clone())


@implements(aten.t.default, aten.transpose.int)
def _transpose(func, args, kwargs):
    t = args[0]
    if _one_scale(t):
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
    if _one_scale(t):
        return _rewrap(t, data)
    new_shape, scale = list(data.shape), t._scale
    if scale.shape[-1] == 1 and new_shape[-1] == t._data.shape[-1]:
        return _rewrap(t, data, scale.reshape(new_shape[:-1] + [1]))
    if scale.numel() == scale.shape[-1] and new_shape[-1] == t._data.shape[-1]:
        return _rewrap(t, data, scale.reshape([1] * (len(new_shape) - 1) + [scale.shape[-1]]))
    raise ValueError(
        f"cannot view a per-axis-scaled Float8Tensor of shape {tuple(t.shape)} (scale "
        f"{tuple(scale.shape)}) as {shape}: only views that keep the last dim move the "
        "scale along; dequantize first"
    )


def _slice_scale(t: Float8Tensor, dim: int, start, end, step=1) -> torch.Tensor:
    _refuse_blocks(t, "slicing")
    if _one_scale(t) or t._scale.shape[dim] == 1:
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
        return _same_weight(t, _rewrap(t, t._data))
    _refuse_blocks(t, f"as_strided to {size}")
    data = func(t._data, *args[1:], **kwargs)
    # (cutting the padding rows keeps the weight: its operands are built from the cut one)
    if _one_scale(t):
        return _same_weight(t, _rewrap(t, data))
    if per_row and t._data.is_contiguous():
        return _same_weight(t, _rewrap(t, data, scale[: size[0]]), size[0])
    raise ValueError(
        f"as_strided on a per-axis-scaled Float8Tensor with scale {tuple(scale.shape)} is only "
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
    shared = all(_one_scale(x) for x in tensors) or all(
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


def scaled_mm(
    a: Float8Tensor,
    b: Float8Tensor,
    *,
    out_dtype: torch.dtype,
    emulate: bool = False,
    use_fast_accum: bool = False,
    pad_inner_dim: bool = False,
) -> torch.Tensor:
    """a (M, K) @ b (K, N) from two Float8Tensors (`fsdp_float8.core.gemm.scaled_mm_data`)."""
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
