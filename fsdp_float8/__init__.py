"""fsdp_float8: float8 training for PyTorch, with float8 weight all-gathers under FSDP2.

model = convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(
    "tensorwise", enable_fsdp_float8_all_gather=True))
fully_shard(...)  # per block, then the root
...
optimizer.step(); precompute_float8_dynamic_scale_for_fsdp(model)
"""

import torch

from fsdp_float8.config import (
    CastConfig,
    DelayedScalingConfig,
    Float8GemmConfig,
    Float8LinearConfig,
    Gemm,
    Operand,
    ScalingGranularity,
    ScalingType,
)
from fsdp_float8.convert import (
    ConversionReport,
    convert_to_float8_training,
    dims_divisible_by_16,
)
from fsdp_float8.float8_ops import scaled_mm
from fsdp_float8.float8_tensor import Float8Tensor, _rebuild_float8_tensor, hp_to_float8
from fsdp_float8.fsdp import (
    precompute_float8_dynamic_scale_for_fsdp,
    sync_float8_amax_and_scale_history,
)
from fsdp_float8.linear import Float8Linear
from fsdp_float8.numerics import sqnr_db
from fsdp_float8.reduce_scatter import Float8ReduceScatter, enable_float8_reduce_scatter
from fsdp_float8.telemetry import Float8Telemetry
from fsdp_float8.weight_wrappers import (
    DelayedFloat8Weight,
    DynamicFloat8Weight,
    StaticFloat8Weight,
)

# checkpoints holding these load with torch.load(weights_only=True)
torch.serialization.add_safe_globals(
    [
        Float8Tensor,
        _rebuild_float8_tensor,
        DynamicFloat8Weight,
        DelayedFloat8Weight,
        StaticFloat8Weight,
    ]
)

__all__ = [
    "CastConfig",
    "ConversionReport",
    "DelayedFloat8Weight",
    "DelayedScalingConfig",
    "DynamicFloat8Weight",
    "Float8GemmConfig",
    "Float8Linear",
    "Float8LinearConfig",
    "Float8ReduceScatter",
    "Float8Telemetry",
    "Float8Tensor",
    "Gemm",
    "Operand",
    "ScalingGranularity",
    "ScalingType",
    "StaticFloat8Weight",
    "convert_to_float8_training",
    "dims_divisible_by_16",
    "enable_float8_reduce_scatter",
    "hp_to_float8",
    "precompute_float8_dynamic_scale_for_fsdp",
    "scaled_mm",
    "sqnr_db",
    "sync_float8_amax_and_scale_history",
]
