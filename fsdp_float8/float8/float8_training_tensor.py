"""torchao.float8.float8_training_tensor: the GEMM configs, the operand roles, and the
scaled cast.

`ScaledMMConfig` / `LinearMMConfig` are named tuples with torchao's fields and defaults (a
torchao checkpoint's pickled configs unpickle to these, see `checkpoint`). fsdp_float8's
layers take their GEMM settings from `Float8LinearConfig`; here the configs only choose
`emulate` for `hp_tensor_and_scale_to_float8`. `GemmInputRole` is fsdp_float8's `Operand`
(the same members and values).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fsdp_float8.core.float8_tensor import Float8Tensor, hp_to_float8
from fsdp_float8.core.gemms import Operand
from fsdp_float8.float8._absent import TRAINING_TENSOR, module_getattr
from fsdp_float8.float8.float8_utils import to_fp8_saturated

GemmInputRole = Operand


class ScaledMMConfig(NamedTuple):
    """One GEMM's settings: `emulate` (float32 GEMM), `use_fast_accum`, `fp8_output`,
    `pad_inner_dim`."""

    emulate: bool = False
    use_fast_accum: bool = False
    fp8_output: bool = False
    pad_inner_dim: bool = False


class LinearMMConfig(NamedTuple):
    """The settings of a linear's three GEMMs (torchao's defaults: fast accumulation for
    `output` only)."""

    output: ScaledMMConfig = ScaledMMConfig(False, True, False, False)
    grad_input: ScaledMMConfig = ScaledMMConfig(False, False, False, False)
    grad_weight: ScaledMMConfig = ScaledMMConfig(False, False, False, False)


_GEMM_OF_ROLES = {
    (Operand.INPUT, Operand.WEIGHT): "output",
    (Operand.GRAD_OUTPUT, Operand.WEIGHT): "grad_input",
    (Operand.GRAD_OUTPUT, Operand.INPUT): "grad_weight",
}


def choose_scaled_mm_config(
    a_role: Operand, a_linear_mm_config: LinearMMConfig, b_role: Operand, b_linear_mm_config
) -> ScaledMMConfig:
    """The config of the GEMM whose left operand has `a_role` and right one `b_role`."""
    gemm = _GEMM_OF_ROLES.get((a_role, b_role))
    if gemm is None:
        raise ValueError(
            f"no linear GEMM takes {a_role} @ {b_role}; expected (INPUT, WEIGHT), "
            "(GRAD_OUTPUT, WEIGHT) or (GRAD_OUTPUT, INPUT)"
        )
    a, b = getattr(a_linear_mm_config, gemm), getattr(b_linear_mm_config, gemm)
    if a != b:
        raise ValueError(f"the operands disagree on the {gemm} GEMM's config: {a} vs {b}")
    return a


def hp_tensor_and_scale_to_float8(
    hp_tensor: torch.Tensor,
    s: torch.Tensor,
    float8_dtype: torch.dtype,
    linear_mm_config: LinearMMConfig | None = None,
    gemm_input_role: Operand | None = Operand.INPUT,
    axiswise_dim: int | None = None,
) -> Float8Tensor:
    """`fsdp_float8.hp_to_float8` with torchao's arguments: the saturating cast of
    `hp_tensor * s`, differentiable (the gradient passes through). The role and the axis are
    accepted for torchao's signature; a `Float8Tensor` does not keep them."""
    emulate = linear_mm_config is not None and linear_mm_config.output.emulate
    return hp_to_float8(hp_tensor, s, float8_dtype, emulate=emulate)


__getattr__ = module_getattr(__name__, {"Float8TrainingTensor": TRAINING_TENSOR})

__all__ = [
    "GemmInputRole",
    "LinearMMConfig",
    "ScaledMMConfig",
    "choose_scaled_mm_config",
    "hp_tensor_and_scale_to_float8",
    "to_fp8_saturated",
]
