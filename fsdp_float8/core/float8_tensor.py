"""Float8Tensor: float8 data plus the scale that maps it back to high precision.

Conventions (said once, here):
- `hp` is a high-precision tensor, `*_fp8` / `_data` float8 data, `amax = max(abs(hp))`.
- `scale` multiplies hp into the float8 range: `fp8 = saturate(hp * scale)`.
- `inv_scale = 1 / scale` dequantizes (`hp ~= fp8 * inv_scale`); it is what
  `torch._scaled_mm` takes.
- A scale is 0-d (tensorwise) or has the data's rank with size 1 on the reduced dim
  (axiswise), so it broadcasts against `_data`; view ops move the scale with the data.
  A block-scaled tensor (`_block` = (rows, cols) of one block, `fsdp_float8.core.blocks`) has
  one scale per block, shape (ceil(R / rows), ceil(C / cols)); it does not broadcast.

The wrapper reports the original high-precision dtype (`_orig_dtype`) as its dtype, so
autograd and FSDP2 see a tensor of the parameter's dtype. Ops on it live in `float8_ops`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import torch
from torch.utils._pytree import tree_leaves

from fsdp_float8.core.blocks import dequantize_blocks
from fsdp_float8.core.scaling import cast_to_float8_data


class OperandCache(Protocol):
    def operand(self, gemm, build: Callable) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def refilled(self) -> None: ...


def normal_outputs(args, kwargs) -> contextlib.AbstractContextManager:
    """Where a subclass's dispatch makes new wrappers: under `torch.inference_mode()` with
    no inference tensor among the arguments, make them normal tensors. Autograd gives the
    view of a normal tensor (FSDP2's `as_strided` of the gathered weight, `view`,
    `detach`) the base's version counter, which an inference tensor cannot take; and what
    FSDP2 builds at its first unshard serves the training steps after."""
    if not torch.is_inference_mode_enabled():
        return contextlib.nullcontext()
    leaves = tree_leaves((args, kwargs))
    return torch.inference_mode(
        any(isinstance(t, torch.Tensor) and t.is_inference() for t in leaves)
    )


class Float8Tensor(torch.Tensor):
    _data: torch.Tensor
    _scale: torch.Tensor
    _orig_dtype: torch.dtype
    _emulate: bool
    _block: tuple[int, int] | None
    # an unsharded weight built by a float8 all-gather: its GEMM operands, built once per
    # unshard (`fsdp_float8.formats.operands.GatheredOperands`); carried by the ops FSDP2
    # applies to it (detach, alias, as_strided), not flattened (compile builds its own)
    _operands: OperandCache | None = None
    # a gathered tensorwise weight's `1 / _scale`, made with it once per all-gather (what
    # the GEMMs multiply by); flattened with data and scale, so a compiled graph takes it
    # as an input instead of computing it again
    _inverse: torch.Tensor | None = None

    @staticmethod
    def __new__(
        cls,
        data: torch.Tensor,
        scale: torch.Tensor,
        orig_dtype: torch.dtype,
        emulate: bool = False,
        block: tuple[int, int] | None = None,
    ):
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=orig_dtype,
            device=data.device,
            requires_grad=False,
        )
        self._data = data
        self._scale = scale
        self._orig_dtype = orig_dtype
        self._emulate = emulate
        self._block = None if block is None else (int(block[0]), int(block[1]))
        return self

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]
        return (
            f"Float8Tensor(dtype={self._data.dtype}, orig_dtype={self._orig_dtype}, "
            f"shape={tuple(self.shape)}, scale_shape={tuple(self._scale.shape)}, "
            f"emulate={self._emulate}{'' if self._block is None else f', block={self._block}'})"
        )

    def __tensor_flatten__(self):
        names = ["_data", "_scale"] if self._inverse is None else ["_data", "_scale", "_inverse"]
        return names, (self._orig_dtype, self._emulate, self._block)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        orig_dtype, emulate, block = meta
        new = Float8Tensor(inner["_data"], inner["_scale"], orig_dtype, emulate, block)
        new._inverse = inner.get("_inverse")
        return new

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from fsdp_float8.core.float8_ops import FLOAT8_OPS

        handler = FLOAT8_OPS.get(func)
        if handler is None:
            raise NotImplementedError(
                f"Float8Tensor does not support {func}; convert it first with "
                ".to_original_precision() (or file an issue if this op should be supported)"
            )
        with normal_outputs(args, kwargs):
            return handler(func, args, kwargs or {})

    @property
    def float8_dtype(self) -> torch.dtype:
        return self._data.dtype

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.reciprocal()

    def dequantize(self) -> torch.Tensor:
        """High-precision value, not differentiable (see `to_original_precision`)."""
        if self._block is not None:
            return dequantize_blocks(self._data, self._scale, self._block, self._orig_dtype)
        return (self._data.to(torch.float32) * self.inv_scale).to(self._orig_dtype)

    def to_original_precision(self) -> torch.Tensor:
        return _FromFloat8.apply(self)

    def __reduce_ex__(self, protocol):
        args = (self._data, self._scale, self._orig_dtype, self._emulate, self._block)
        return (_rebuild_float8_tensor, args)


def _rebuild_float8_tensor(data, scale, orig_dtype, emulate, block=None):
    return Float8Tensor(data, scale, orig_dtype, emulate, block)


class _ToFloat8(torch.autograd.Function):
    """hp -> Float8Tensor; the gradient passes straight through (cast is treated as identity)."""

    @staticmethod
    def forward(ctx, hp, scale, float8_dtype, emulate):
        data = cast_to_float8_data(hp, scale, float8_dtype)
        return Float8Tensor(data, scale, hp.dtype, emulate)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class _FromFloat8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fp8: Float8Tensor):
        return fp8.dequantize()

    @staticmethod
    def backward(ctx, grad):
        return grad


def hp_to_float8(
    hp: torch.Tensor,
    scale: torch.Tensor,
    float8_dtype: torch.dtype,
    *,
    emulate: bool = False,
) -> Float8Tensor:
    """The one differentiable constructor: saturating cast of `hp` with `scale`."""
    if isinstance(hp, Float8Tensor):
        raise TypeError("hp_to_float8 got a Float8Tensor; it expects a high-precision tensor")
    if scale.dtype != torch.float32:
        raise TypeError(f"scale must be float32, got {scale.dtype}; torch._scaled_mm needs it")
    return _ToFloat8.apply(hp, scale, float8_dtype, emulate)
