"""torchao.float8.float8_scaling_utils: dynamic scaling of a high-precision tensor."""

from __future__ import annotations

import torch

from fsdp_float8.core.config import ScalingGranularity
from fsdp_float8.core.float8_tensor import Float8Tensor
from fsdp_float8.core.gemms import Operand
from fsdp_float8.float8._absent import INTERNAL, TRAINING_TENSOR, module_getattr
from fsdp_float8.float8.distributed_utils import tensor_already_casted_to_fp8
from fsdp_float8.float8.float8_training_tensor import (
    GemmInputRole,
    LinearMMConfig,
    hp_tensor_and_scale_to_float8,
)
from fsdp_float8.float8.float8_utils import tensor_to_scale


def hp_tensor_to_float8_dynamic(
    hp_tensor: torch.Tensor,
    float8_dtype: torch.dtype,
    linear_mm_config: LinearMMConfig | None,
    reduce_amax: bool = False,
    gemm_input_role: Operand = GemmInputRole.INPUT,
    device_mesh=None,
    scaling_granularity: ScalingGranularity = ScalingGranularity.TENSORWISE,
    axiswise_dim: int | None = None,
    round_scales_to_power_of_2: bool = False,
) -> Float8Tensor:
    """`hp_tensor` cast to float8 with a scale from its own amax (`tensor_to_scale`)."""
    scale = tensor_to_scale(
        hp_tensor,
        float8_dtype,
        reduce_amax,
        device_mesh,
        scaling_granularity,
        axiswise_dim,
        round_scales_to_power_of_2,
    )
    return hp_tensor_and_scale_to_float8(
        hp_tensor, scale, float8_dtype, linear_mm_config, gemm_input_role, axiswise_dim
    )


def get_maybe_axiswise_dim(
    axiswise_dim: int, scaling_granularity: ScalingGranularity
) -> int | None:
    """`axiswise_dim` for axiswise scaling, else None."""
    return axiswise_dim if scaling_granularity is ScalingGranularity.AXISWISE else None


__getattr__ = module_getattr(
    __name__, {"NoopFwToFloat8BwDynamic": INTERNAL, "Float8TrainingTensor": TRAINING_TENSOR}
)

__all__ = [
    "GemmInputRole",
    "LinearMMConfig",
    "ScalingGranularity",
    "get_maybe_axiswise_dim",
    "hp_tensor_and_scale_to_float8",
    "hp_tensor_to_float8_dynamic",
    "tensor_already_casted_to_fp8",
    "tensor_to_scale",
]
