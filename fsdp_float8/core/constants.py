"""Tensor constants made once per (value, dtype, device, rank): `constant`.

A Python number that meets a tensor in an op on every call (the scale chain's float64 floor,
a static scale) would otherwise be a new tensor each time, on CUDA a pageable host-to-device
copy. Each constant is shared by every caller and read-only: never write into one.
"""

from __future__ import annotations

import torch

_CONSTANTS: dict[tuple, torch.Tensor] = {}


def constant(value: float, dtype: torch.dtype, device, dims: int = 0) -> torch.Tensor:
    """`value` as a tensor of `dims` size-1 dims, made once per (value, dtype, device, dims):
    no op, and on CUDA no pageable host-to-device copy, per use. Shared and read-only."""
    key = (float(value), dtype, torch.device(device), dims)
    const = _CONSTANTS.get(key)
    if const is None:
        with torch.inference_mode(False), torch.no_grad():  # usable by autograd later
            const = _CONSTANTS[key] = torch.full((1,) * dims, key[0], dtype=dtype, device=key[2])
    return const
