"""The rules of a Float8LinearConfig's casts, checked by `fsdp_float8.core.config` at
construction, each raising ValueError naming the values and the remedy:

- one cast's block fields: `block_shape` exactly for blockwise casts, e8m0 scales only there;
- both operands of a GEMM are float8, or both high precision;
- delayed and static scaling keep one scale per operand, so its two uses share the type;
- a float8 all-gathered weight serves both weight GEMMs (its family's rule);
- a float8 input saved for grad_weight is cast alike for output and grad_weight;
- block casts refuse pad_inner_dim, and e8m0 scales need power-of-two rounding;
- under power-of-two rounding a static scale (used as given) is a power of two;
- CUDA float8 GEMMs refuse two e5m2 operands (checked unless emulated);
- a static scale keeps fp8_max / scale and 1 / scale finite normal float32s;
- a non-default `delayed_scaling_config` needs a delayed cast to read it;
- a non-default `use_fast_accum` needs a GEMM that reads it (float8, not MX).

Works on `CastConfig` objects (the resolved casts: `(Operand, Gemm)` -> CastConfig, target
dtypes filled in) through what they answer: `enabled`, `keeps_scale` (the one place the
scaling-type words become behaviour is config.py), their granularity's format family
(`ScalingGranularity.family`, `fsdp_float8.core.families`) and their fields. config.py
imports this module; this module imports nothing of config.py. The topology comes from
`fsdp_float8.core.gemms`.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import torch

from fsdp_float8.core.config_fields import Float8ConfigError
from fsdp_float8.core.families import Family, granularities_where, recipes_where
from fsdp_float8.core.gemms import GEMM_OPERANDS, OPERANDS, PRIMARY_GEMM, SECOND_GEMM, Gemm, Operand
from fsdp_float8.core.scaling import float8_max

Casts = dict[tuple[Operand, Gemm], Any]  # the CastConfig of each (operand, GEMM)
E8M0 = torch.float8_e8m0fnu
SCALE_DTYPES = (torch.float32, E8M0)


def check_block_cast(cast: Any) -> None:
    """A CastConfig's block fields: `block_shape` exactly for blockwise (the casts whose
    family's scales are blocks), two ints >= 1; `scale_dtype` float32, or e8m0 for
    blockwise only."""
    granularity = cast.scaling_granularity.value  # for the messages
    block_shape, scale_dtype = cast.block_shape, cast.scale_dtype
    blockwise = not cast.scaling_granularity.family.broadcast_scales
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


def check_cast_pairs(casts: Casts, *, fsdp_all_gather: bool, save_input_in_float8: bool) -> None:
    """The rules over pairs of casts: a GEMM's two operands, an operand's two uses, and
    what the float8 all-gather and the saved float8 input share."""
    for gemm, (left, right) in GEMM_OPERANDS.items():
        a, b = casts[(left, gemm)], casts[(right, gemm)]
        if a.enabled != b.enabled:
            raise Float8ConfigError(
                f"incompatible operand precision for {gemm.value}: the {gemm.value} GEMM has "
                f"{left.value} {a.scaling_type.value} but "
                f"{right.value} {b.scaling_type.value}: both operands of a GEMM "
                "must be float8 or both high precision; disable or enable both"
            )
    for operand in OPERANDS:
        _check_second_use(casts, operand)
    if fsdp_all_gather:
        _check_fsdp_all_gather(
            casts[(Operand.WEIGHT, Gemm.OUTPUT)], casts[(Operand.WEIGHT, Gemm.GRAD_INPUT)]
        )
    if save_input_in_float8:
        _check_save_input_in_float8(
            casts[(Operand.INPUT, Gemm.OUTPUT)], casts[(Operand.INPUT, Gemm.GRAD_WEIGHT)]
        )


def _check_second_use(casts: Casts, operand: Operand) -> None:
    first = casts[(operand, PRIMARY_GEMM[operand])]
    second = casts[(operand, SECOND_GEMM[operand])]
    kinds = (first.scaling_type.value, second.scaling_type.value)  # for the message
    stateful = first.keeps_scale or second.keeps_scale
    if stateful and second.enabled and first.scaling_type != second.scaling_type:
        raise Float8ConfigError(
            f"{operand.value} is {kinds[0]} for its first GEMM but {kinds[1]} for "
            f"{SECOND_GEMM[operand].value}; delayed and static scaling keep one scale per "
            "operand, so both uses must share the scaling type (or disable the second use)"
        )


def _check_fsdp_all_gather(fwd, bwd) -> None:
    """The gathered weight serves both weight GEMMs, as its family's rule says
    (`Family.all_gather_rule`): one scale or square blocks serve both as gathered; per-row
    scales (local to each dim-0 shard) have the grad_input weight re-cast from the rows."""
    if not (fwd.enabled and bwd.enabled):
        raise Float8ConfigError(
            "enable_fsdp_float8_all_gather=True needs a float8 weight in both weight "
            f"GEMMs, got output={fwd.scaling_type.value}, grad_input="
            f"{bwd.scaling_type.value}; enable both or set enable_fsdp_float8_all_gather=False"
        )
    rule = fwd.scaling_granularity.family.all_gather_rule
    assert rule is not None  # every float8 family has one
    rule(fwd, bwd)


def _check_save_input_in_float8(first, second) -> None:
    """One scale: backward reuses the forward's float8 input. Blocks: forward also casts
    the input for grad_weight (tiles along the token dim) and saves that
    (`Family.saves_float8_input`)."""
    kinds = {c.scaling_granularity for c in (first, second) if c.enabled}
    both = first.enabled and second.enabled and len(kinds) == 1
    same = first.target_dtype == second.target_dtype
    if not (same and both and all(k.family.saves_float8_input for k in kinds)):
        saving = granularities_where(_saves_float8)
        raise Float8ConfigError(
            "save_input_in_float8=True keeps a float8 input for grad_weight, which needs "
            f"input {saving} with the same dtype for output and "
            f"grad_weight; use the {recipes_where(_saves_float8)} recipe or set "
            "save_input_in_float8=False"
        )


def _saves_float8(family: Family) -> bool:
    return family.saves_float8_input and family.granularity is not None


def check_linear_blocks(casts: dict[str, Any], *, pad_inner_dim: bool, power_of_2: bool) -> None:
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


def check_static_power_of_2(casts: dict[str, Any]) -> None:
    """Under `round_scales_to_power_of_2` every static scale must be a power of two: a
    static scale is used as given, never rounded (field name -> CastConfig)."""
    for name, cast in casts.items():
        scale = cast.static_scale
        if scale is not None and math.frexp(scale)[0] != 0.5:
            down = 2.0 ** (math.frexp(scale)[1] - 1)
            raise Float8ConfigError(
                f"{name} has static_scale={scale!r}, which is used as given, but "
                "round_scales_to_power_of_2=True asks for power-of-two scales; pass a power "
                f"of two (static_scale={down!r} rounds it down) or set "
                "round_scales_to_power_of_2=False"
            )


def check_no_e5m2_pair(casts: Casts) -> None:
    """CUDA float8 GEMMs (cuBLASLt) refuse e5m2 x e5m2; CPU and emulation take it."""
    for gemm, (left, right) in GEMM_OPERANDS.items():
        pair = (casts[(left, gemm)], casts[(right, gemm)])
        if all(c.enabled and c.target_dtype == torch.float8_e5m2 for c in pair):
            raise Float8ConfigError(
                f"the {gemm.value} GEMM multiplies {left.value} and {right.value}, both "
                "float8_e5m2: CUDA torch._scaled_mm refuses two e5m2 operands. Make one of "
                "them float8_e4m3fn (CastConfig(target_dtype=torch.float8_e4m3fn)), or set "
                "emulate=True"
            )


def check_static_scale(scale: float | None, dtypes: tuple[torch.dtype, ...]) -> None:
    """A user-given static scale must be finite and > 0, with fp8_max / scale (the largest
    hp value the cast keeps) a finite float32 and 1 / scale (what the GEMM multiplies by)
    not underflowing float32, or outputs come out NaN or all zero."""
    if scale is None or not scale > 0 or not math.isfinite(scale):
        raise ValueError(
            f"static scaling needs a finite static_scale > 0, got {scale!r}; pass "
            "CastConfig(scaling_type='static', static_scale=<fp8_max / expected amax>)"
        )
    f32 = torch.finfo(torch.float32)
    lo = max(float8_max(d) for d in dtypes) / f32.max
    hi = 1 / f32.tiny
    if not lo <= scale <= hi:
        raise ValueError(
            f"static_scale={scale!r} is outside [{lo:.3g}, {hi:.3g}]: fp8_max / "
            "static_scale must be a finite float32 and 1 / static_scale must not "
            "underflow. The scale multiplies values into float8 range: pass fp8_max / "
            "expected amax (e.g. 448 / 3.0 for an e4m3 tensor with |x| <= 3)"
        )


def check_delayed_scaling_config(given: object, default: object, *, read: bool) -> None:
    """Only delayed casts read `delayed_scaling_config` (`read`: some cast is delayed): a
    non-default one with none would change nothing."""
    if read or given == default:
        return
    raise Float8ConfigError(
        f"delayed_scaling_config={given} is only read by delayed casts, but no cast is "
        "delayed; make the casts delayed (CastConfig(scaling_type='delayed')) or drop "
        "delayed_scaling_config"
    )


def check_share_input_casts(share: bool, not_dynamic: dict[Gemm, str]) -> None:
    """`share_input_casts` shares dynamic casts of the input's two uses (forward and
    grad_weight; `not_dynamic`: the scaling type of each use that is not dynamic): with
    any other input cast it would share nothing."""
    for gemm, kind in not_dynamic.items():
        if share:
            raise Float8ConfigError(
                f"share_input_casts=True shares dynamic casts of the input, but its cast for "
                f"the {gemm.value} GEMM is {kind}: nothing would be shared. Use dynamic "
                "input casts (both uses, not disabled) or share_input_casts=False"
            )


def check_gemm_configs(casts: Casts, config: Any) -> None:
    """Only a float8 GEMM whose scales are not e8m0 reads its `Float8GemmConfig`
    (`config.gemm_config(gemm)`; the default: the field's): a high-precision GEMM and an MX
    GEMM (its kernel takes no fast-accumulation setting; emulated, neither) would ignore a
    non-default one."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    for gemm, (left, right) in GEMM_OPERANDS.items():
        given, default = config.gemm_config(gemm), fields[f"gemm_config_{gemm.value}"].default
        if given == default:
            continue
        if not casts[(left, gemm)].enabled:
            why = f"runs in high precision ({left.value} and {right.value} casts disabled)"
        elif casts[(left, gemm)].scale_dtype == E8M0:
            why = "is an MX GEMM (e8m0 block scales), whose kernel takes no such setting"
        else:
            continue
        raise Float8ConfigError(
            f"gemm_config_{gemm.value}={given} is read only by a float8 GEMM with float32 "
            f"scales, but the {gemm.value} GEMM {why}: it would change nothing; drop "
            f"gemm_config_{gemm.value} (default {default})"
        )


def warn_force_recompute() -> None:
    """`force_recompute_fp8_weight_in_bwd=True`: deprecated, no effect (as in torchao). A
    FutureWarning, not a DeprecationWarning: Python's default filters hide the latter
    outside __main__, and torchao logs this one unconditionally."""
    warnings.warn(
        "Float8LinearConfig.force_recompute_fp8_weight_in_bwd is deprecated and has "
        "no effect (as in torchao): the weight's float8 copy for backward is not "
        "configurable; drop the argument",
        FutureWarning,
        stacklevel=4,
    )
