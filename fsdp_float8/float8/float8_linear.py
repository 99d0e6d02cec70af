"""torchao.float8.float8_linear: the float8 linear layer, and the names torchao's module
imports (accelerate imports `Float8LinearConfig` from here)."""

from fsdp_float8.core.config import Float8LinearConfig, ScalingType
from fsdp_float8.float8._absent import INTERNAL, module_getattr
from fsdp_float8.float8.distributed_utils import tensor_already_casted_to_fp8
from fsdp_float8.float8.float8_scaling_utils import (
    get_maybe_axiswise_dim,
    hp_tensor_to_float8_dynamic,
)
from fsdp_float8.float8.float8_training_tensor import (
    GemmInputRole,
    LinearMMConfig,
    ScaledMMConfig,
)
from fsdp_float8.nn.linear import Float8Linear
from fsdp_float8.weight_wrappers.dynamic import (
    DynamicFloat8Weight as WeightWithDynamicFloat8CastTensor,
)

__getattr__ = module_getattr(__name__, {"matmul_with_hp_or_float8_args": INTERNAL})

__all__ = [
    "Float8Linear",
    "Float8LinearConfig",
    "GemmInputRole",
    "LinearMMConfig",
    "ScaledMMConfig",
    "ScalingType",
    "WeightWithDynamicFloat8CastTensor",
    "get_maybe_axiswise_dim",
    "hp_tensor_to_float8_dynamic",
    "tensor_already_casted_to_fp8",
]
