"""Numerics helpers shared by tests and scripts: SQNR and saturation/underflow counts.

SQNR_DB holds the named thresholds every test uses (measured on randn on this machine, with
the field's usual bars for a linear layer).
"""

from __future__ import annotations

import functools

import torch

from fsdp_float8.core.scaling import float8_max

SQNR_DB = {
    "cast_e4m3": 25.0,
    "cast_e5m2": 20.0,
    "gemm_e4m3": 25.0,
    "linear_output": 18.0,
    "linear_grad_input": 18.0,
    "linear_grad_weight": 17.0,
    # torch._scaled_mm against its float32 emulation on the same float8 operands: bit-equal
    # on CPU here (both dequantize, then a float32 GEMM); a GPU's accumulation order differs.
    "real_vs_emulated": 40.0,
}


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20*log10(|ref| / |ref - approx|)."""
    ref = reference.detach().to(torch.float64)
    err = ref - approx.detach().to(torch.float64)
    noise = err.norm()
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(ref.norm() / noise))


def saturation_fraction(hp: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype):
    """Fraction of elements whose scaled magnitude exceeds the float8 max (clamped)."""
    scaled = hp.detach().to(torch.float32).abs() * scale
    return (scaled > float8_max(float8_dtype)).float().mean()


def underflow_fraction(hp: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype):
    """Fraction of non-zero elements that become zero in float8."""
    x = hp.detach().to(torch.float32)
    fp8 = (x * scale).clamp(-float8_max(float8_dtype), float8_max(float8_dtype))
    zeroed = (fp8.to(float8_dtype).to(torch.float32) == 0) & (x != 0)
    return zeroed.float().mean()


@functools.cache
def float8_rounding_max(float8_dtype: torch.dtype) -> float:
    """The largest scaled magnitude that rounds to the float8 max: the max plus half the
    spacing of float8 values just below it (e4m3fn 464, e5m2 61440). Up to it, the
    saturating clamp changes an element no more than rounding would."""
    fmax = torch.tensor(float8_max(float8_dtype)).to(float8_dtype)
    below = (fmax.view(torch.uint8) - 1).view(float8_dtype)  # the next float8 value down
    return float(fmax.float() + (fmax.float() - below.float()) / 2)


def out_of_range_fraction(hp: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype):
    """Fraction of elements that saturate beyond rounding: scaled magnitude above
    `float8_rounding_max`, so the clamp, not rounding, sets their float8 value. Unlike
    `saturation_fraction` (> max), an element a hair above the max does not count, e.g. the
    amax element of a dynamically scaled tensor when its float32 scale rounded up."""
    scaled = hp.detach().to(torch.float32).abs() * scale
    return (scaled > float8_rounding_max(float8_dtype)).float().mean()
