"""torchao.float8.float8_tensor_parallel: the float8 tensor-parallel styles (torch's
arguments; `PrepareFloat8ModuleInput` also takes torchao's `float8_dtype` and
`fwd_config_submodule_fqn`)."""

from fsdp_float8.core.config import E4M3 as e4m3_dtype
from fsdp_float8.core.config import ScalingType
from fsdp_float8.float8._absent import INTERNAL, module_getattr
from fsdp_float8.float8.distributed_utils import tensor_already_casted_to_fp8
from fsdp_float8.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
from fsdp_float8.float8.float8_training_tensor import GemmInputRole
from fsdp_float8.tensor_parallel.input import PrepareFloat8ModuleInput
from fsdp_float8.tensor_parallel.styles import Float8ColwiseParallel, Float8RowwiseParallel

__getattr__ = module_getattr(__name__, {"NoopFwToFloat8BwDynamic": INTERNAL})

__all__ = [
    "Float8ColwiseParallel",
    "Float8RowwiseParallel",
    "GemmInputRole",
    "PrepareFloat8ModuleInput",
    "ScalingType",
    "e4m3_dtype",
    "hp_tensor_to_float8_dynamic",
    "tensor_already_casted_to_fp8",
]
