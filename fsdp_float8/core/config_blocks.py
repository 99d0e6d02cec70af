"""The block-scaled casts' rules (`scaling_granularity="blockwise"`), checked by
`fsdp_float8.core.config` at construction: one home for them, so config.py stays the map from
words to strategies. Each rule raises ValueError naming the value and the remedy.

Works on plain values (the granularity's string value, the fields), so it imports nothing
from config.py, which imports it.
"""

from __future__ import annotations

import torch

from fsdp_float8.core.config_fields import Float8ConfigError

E8M0 = torch.float8_e8m0fnu
SCALE_DTYPES = (torch.float32, E8M0)


def check_block_cast(granularity: str, block_shape, scale_dtype: torch.dtype) -> None:
    """A CastConfig's block fields: `block_shape` exactly for blockwise, two ints >= 1;
    `scale_dtype` float32, or e8m0 for blockwise only."""
    blockwise = granularity == "blockwise"
    ints = isinstance(block_shape, tuple) and len(block_shape) == 2
    ints = ints and all(type(b) is int and b >= 1 for b in block_shape)
    if blockwise and not ints:
        raise Float8ConfigError(
            f"scaling_granularity=blockwise needs block_shape=(across, along) the "
            f"contraction dim as two ints >= 1, got block_shape={block_shape!r}; e.g. "
            "(1, 128) for activation tiles, (128, 128) for weight blocks, (1, 32) / (32, 32) for MX"
        )
    if not blockwise and block_shape is not None:
        raise Float8ConfigError(
            f"block_shape={block_shape!r} is only used with scaling_granularity=blockwise, "
            f"got {granularity}; drop block_shape or make the cast blockwise"
        )
    if scale_dtype not in SCALE_DTYPES:
        raise Float8ConfigError(
            f"scale_dtype={scale_dtype} is not supported; expected torch.float32 or "
            "torch.float8_e8m0fnu (MX block scales)"
        )
    if scale_dtype == E8M0 and not blockwise:
        raise Float8ConfigError(
            f"scale_dtype={scale_dtype} (e8m0) is for blockwise (MX) casts, got "
            f"scaling_granularity={granularity}; use scale_dtype=torch.float32 or "
            "scaling_granularity='blockwise' with a block_shape"
        )


def check_linear_blocks(casts: dict, *, pad_inner_dim: bool, power_of_2: bool) -> None:
    """Float8LinearConfig-level rules over its casts (field name -> CastConfig)."""
    blockwise = [name for name, c in casts.items() if c.block_shape is not None]
    if blockwise and pad_inner_dim:
        raise Float8ConfigError(
            f"pad_inner_dim=True pads K and N to multiples of 16 for torch._scaled_mm, but "
            f"{blockwise[0]} is blockwise: block GEMMs tile any shape when emulated and need "
            "multiples of 128 (32 for MX) on CUDA; drop pad_inner_dim, or keep layers whose "
            "dims are not multiples of 16 in high precision"
        )
    e8m0 = [name for name, c in casts.items() if c.scale_dtype == E8M0]
    if e8m0 and not power_of_2:
        raise Float8ConfigError(
            f"{e8m0[0]} has scale_dtype=torch.float8_e8m0fnu, which holds powers of two only, "
            "but round_scales_to_power_of_2=False; set it True (the 'mxfp8' recipe does) or "
            "use float32 block scales"
        )


def check_block_all_gather(fwd, bwd) -> None:
    """A gathered block weight serves both weight GEMMs as it is: one cast, so square
    blocks (the same whichever dim is contracted) and one config for both GEMMs."""
    if fwd != bwd or fwd.block_shape[0] != fwd.block_shape[1]:
        raise Float8ConfigError(
            "enable_fsdp_float8_all_gather=True with a blockwise weight gathers one float8 "
            "weight for both weight GEMMs, which needs square blocks and one cast config; "
            f"got cast_config_weight={fwd}, cast_config_weight_for_grad_input={bwd}; use "
            "square blocks (e.g. (128, 128)) and leave the grad_input one None"
        )
