"""torchao's short words for a Float8Linear's casts (its repr): `i:dyn_ten_e4m3,w:...`,
and this package's for what torchao lacks (blocks, e8m0 scales)."""

from __future__ import annotations

import torch

from fsdp_float8.core.gemms import OPERANDS, PRIMARY_GEMM, SECOND_GEMM, Gemm, Operand


def _short(cfg) -> str:
    """One cast as torchao writes it, scaling_granularity_dtype: dyn_ten_e4m3,
    dis_ten_e4m3, dyn_axs_e4m3; delayed and static are del_ / sta_; a block cast adds its
    block shape (dyn_blk1x128_e4m3) and an e8m0 scale dtype (..._e8m0scale)."""
    gran = cfg.scaling_granularity.family.short  # torchao's words (ten, axs), and blk
    if cfg.block_shape is not None:
        gran += f"{cfg.block_shape[0]}x{cfg.block_shape[1]}"
    text = f"{cfg.scaling_type.value[:3]}_{gran}_{_dtype_name(cfg.target_dtype)}"
    if cfg.scale_dtype != torch.float32:
        text += f"_{_dtype_name(cfg.scale_dtype)}scale"
    return text


# the short names of torchao's repr: operands i, w, go; second GEMMs gw, gi
_OPERAND_WORD = {Operand.INPUT: "i", Operand.WEIGHT: "w", Operand.GRAD_OUTPUT: "go"}
_GEMM_WORD = {Gemm.GRAD_WEIGHT: "gw", Gemm.GRAD_INPUT: "gi"}


def cast_configs(config) -> str:
    """Each operand's first cast (`i:dyn_ten_e4m3`), then `i_gw` / `w_gi` / `go_gw` for a
    second use cast otherwise."""
    c = config
    firsts = [f"{_OPERAND_WORD[op]}:{_short(c.cast(op, PRIMARY_GEMM[op]))}" for op in OPERANDS]
    seconds = [
        f"{_OPERAND_WORD[op]}_{_GEMM_WORD[SECOND_GEMM[op]]}:{_short(c.cast(op, SECOND_GEMM[op]))}"
        for op in OPERANDS
        if c.cast(op, SECOND_GEMM[op]) != c.cast(op, PRIMARY_GEMM[op])
    ]
    return ",".join(firsts + seconds)


_DTYPE_WORD = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", torch.float8_e8m0fnu: "e8m0"}


def _dtype_name(dtype: torch.dtype | None) -> str:
    """torchao's words for the float8 dtypes (e4m3, e5m2); others by their torch name."""
    if dtype in _DTYPE_WORD:
        return _DTYPE_WORD[dtype]
    return str(dtype).removeprefix("torch.float8_")
