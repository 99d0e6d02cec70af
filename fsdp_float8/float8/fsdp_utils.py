"""torchao.float8.fsdp_utils: the float8 all-gather weight and the scale precompute.

`WeightWithDynamicFloat8CastTensor` is fsdp_float8's `DynamicFloat8Weight`, the weight a
dynamically scaled tensorwise layer with `enable_fsdp_float8_all_gather=True` holds (an
`isinstance` check on a converted model's weights holds as with torchao). A torchao
checkpoint that pickled torchao's class loads without torchao: see `checkpoint`.
"""

from fsdp_float8.float8._absent import TRAINING_TENSOR, module_getattr
from fsdp_float8.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
from fsdp_float8.float8.float8_training_tensor import (
    GemmInputRole,
    LinearMMConfig,
    hp_tensor_and_scale_to_float8,
)
from fsdp_float8.float8.float8_utils import EPS
from fsdp_float8.fsdp.step import precompute_float8_dynamic_scale_for_fsdp
from fsdp_float8.weight_wrappers.dynamic import (
    DynamicFloat8Weight as WeightWithDynamicFloat8CastTensor,
)

__getattr__ = module_getattr(__name__, {"Float8TrainingTensor": TRAINING_TENSOR})

__all__ = [
    "EPS",
    "GemmInputRole",
    "LinearMMConfig",
    "WeightWithDynamicFloat8CastTensor",
    "hp_tensor_and_scale_to_float8",
    "hp_tensor_to_float8_dynamic",
    "precompute_float8_dynamic_scale_for_fsdp",
]
