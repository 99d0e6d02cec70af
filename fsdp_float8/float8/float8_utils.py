"""torchao.float8.float8_utils: the scale math and small helpers, on fsdp_float8's one
scale path (`fsdp_float8.core.scaling`), so a scale computed here is the scale a
`Float8Linear` computes.

Differences from torchao: amaxes are float32 (the same value: the max of bf16 numbers is
exact in float32); `tensor_to_amax(reduce_amax=True)` is refused (reduce inside
`tensor_to_scale(reduce_amax=True)`, where fsdp_float8's one amax reduction runs); the
float8 dtypes are `torch.float8_e4m3fn` and `torch.float8_e5m2` (no AMD `fnuz` pair).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.nn import functional as F

from fsdp_float8.core.config import E4M3, E5M2, ScalingGranularity
from fsdp_float8.core.scaling import (
    axis_amax,
    float8_max,
    scale_from_amax,
    tensor_amax,
)

FP8_TYPES = {E4M3, E5M2}
# torchao's amax floor, kept as a name; fsdp_float8 floors an amax at fp8_max / MAX_SCALE
# instead (far below 1e-12), so amaxes of 1e-12 and above give torchao's scales exactly
# and smaller ones keep their float8 precision instead of being capped.
EPS = 1e-12
IS_ROCM = False  # fsdp_float8 casts to the e4m3fn / e5m2 pair on every device


def _check_dtype(float8_dtype: torch.dtype) -> None:
    if float8_dtype not in FP8_TYPES:
        raise ValueError(
            f"float8_dtype {float8_dtype} is not supported; expected torch.float8_e4m3fn "
            "or torch.float8_e5m2"
        )


@torch.no_grad()
def _amax_to_scale(
    amax: torch.Tensor, float8_dtype: torch.dtype, round_scales_to_power_of_2: bool = False
) -> torch.Tensor:
    """fp8_max / max(amax, fp8_max / MAX_SCALE), divided in float64, as float32 (optionally rounded down to
    a power of two): the scale path of `fsdp_float8.core.scaling` without a reduction."""
    _check_dtype(float8_dtype)
    return scale_from_amax(amax, float8_dtype, power_of_2=round_scales_to_power_of_2)


# torchao's name and signature for the one scale path (its arithmetic stays in core.scaling)
amax_to_scale = _amax_to_scale
amax_to_scale.__name__ = amax_to_scale.__qualname__ = "amax_to_scale"


@torch.no_grad()
def tensor_to_amax(
    x: torch.Tensor,
    reduce_amax: bool = False,
    device_mesh=None,
    scaling_granularity: ScalingGranularity = ScalingGranularity.TENSORWISE,
    axiswise_dim: int | None = None,
) -> torch.Tensor:
    """max |x| (0-d), or along `axiswise_dim` (kept) for axiswise granularity, float32."""
    if reduce_amax:
        raise NotImplementedError(
            "tensor_to_amax(reduce_amax=True) is not provided: call "
            "tensor_to_scale(x, float8_dtype, reduce_amax=True, device_mesh=...), which "
            "reduces the amax over the ranks before computing the scale"
        )
    if scaling_granularity is ScalingGranularity.TENSORWISE:
        return tensor_amax(x)
    if scaling_granularity is not ScalingGranularity.AXISWISE or axiswise_dim is None:
        raise ValueError(
            f"scaling_granularity {scaling_granularity} with axiswise_dim {axiswise_dim}: "
            "expected TENSORWISE, or AXISWISE with an axiswise_dim"
        )
    return axis_amax(x, axiswise_dim)


@torch.no_grad()
def tensor_to_scale(
    hp_tensor: torch.Tensor,
    float8_dtype: torch.dtype,
    reduce_amax: bool = False,
    device_mesh=None,
    scaling_granularity: ScalingGranularity = ScalingGranularity.TENSORWISE,
    axiswise_dim: int | None = None,
    round_scales_to_power_of_2: bool = False,
) -> torch.Tensor:
    """The float32 scale of `hp_tensor`; `reduce_amax` takes the MAX of the amax over
    `device_mesh`'s ranks (the whole world without a mesh) first."""
    _check_dtype(float8_dtype)
    amax = tensor_to_amax(hp_tensor, False, None, scaling_granularity, axiswise_dim)
    group = None
    if reduce_amax and dist.is_initialized():
        group = device_mesh if device_mesh is not None else dist.group.WORLD
    return scale_from_amax(amax, float8_dtype, power_of_2=round_scales_to_power_of_2, group=group)


def to_fp8_saturated(x: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """`x` (already scaled) clamped to the float8 range, then cast."""
    _check_dtype(float8_dtype)
    fmax = float8_max(float8_dtype)
    return x.clamp(min=-fmax, max=fmax).to(float8_dtype)


def compute_error(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """SQNR of `y` against `x` in dB, as a tensor: 20 log10(|x| / |x - y|)
    (`fsdp_float8.sqnr_db` is the same number as a Python float, computed in float64)."""
    return 20 * torch.log10(x.norm() / (x - y).norm())


def fp8_tensor_statistics(tensor, float8_dtype: torch.dtype) -> tuple[int, int]:
    """(zeros, values at the float8 max in magnitude) of a `Float8Tensor`'s data."""
    _check_dtype(float8_dtype)
    values = tensor._data.to(tensor._orig_dtype)
    fmax = float8_max(float8_dtype)
    return int((values == 0).sum()), int((values.abs() == fmax).sum())


def is_row_major(stride) -> bool:
    if len(stride) != 2:
        raise ValueError(f"is_row_major takes a 2-D stride, got {tuple(stride)}")
    return stride[0] > stride[1] and stride[1] == 1


def pad_tensor_for_matmul(tensor: torch.Tensor, dims: int | Iterable[int]) -> torch.Tensor:
    """`tensor` (2-D) zero-padded at the end of `dims` to multiples of 16."""
    if tensor.dim() != 2:
        raise ValueError(f"pad_tensor_for_matmul takes a 2-D tensor, got {tensor.dim()}-D")
    wanted = {dims} if isinstance(dims, int) else set(dims)
    pad = [(-size) % 16 if d in wanted else 0 for d, size in enumerate(tensor.shape)]
    return F.pad(tensor, (0, pad[1], 0, pad[0]))


__all__ = [
    "EPS",
    "ScalingGranularity",
    "FP8_TYPES",
    "IS_ROCM",
    "amax_to_scale",
    "compute_error",
    "fp8_tensor_statistics",
    "is_row_major",
    "pad_tensor_for_matmul",
    "tensor_to_amax",
    "tensor_to_scale",
    "to_fp8_saturated",
]
