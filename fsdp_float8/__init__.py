"""fsdp_float8: float8 training for PyTorch, with float8 weight all-gathers under FSDP2.

model = convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(
    "tensorwise", enable_fsdp_float8_all_gather=True))
fully_shard(...)  # per block, then the root
...
loss.backward(); optimizer.step()  # no float8 call: the float8 step refreshes the scales

Coming from torchao.float8: the same names import from here (see README, "Migrating from
torchao"). Optional features that lean on private torch APIs (`enable_float8_reduce_scatter`,
`Float8ReduceScatter`: FSDP2's private `ReduceScatter`) are imported on first use, so
`import fsdp_float8` works on a torch that renamed them.
"""

import importlib
import importlib.metadata
from collections.abc import Callable

import torch

from fsdp_float8.core.config import (
    CastConfig,
    DelayedScalingConfig,
    Float8GemmConfig,
    Float8LinearConfig,
    Float8LinearRecipeName,
    ScalingGranularity,
    ScalingType,
)
from fsdp_float8.core.config_fields import Float8ConfigError
from fsdp_float8.core.delayed_state import export_state_dict
from fsdp_float8.core.float8_ops import scaled_mm
from fsdp_float8.core.float8_tensor import Float8Tensor, _rebuild_float8_tensor, hp_to_float8
from fsdp_float8.core.gemms import Gemm, Operand
from fsdp_float8.core.numerics import sqnr_db
from fsdp_float8.core.recipes import _auto_filter_for_recipe
from fsdp_float8.experts.gemm import ExpertCastPlan, float8_grouped_mm
from fsdp_float8.experts.modules import Float8FusedExperts, Float8GroupedExperts
from fsdp_float8.experts.nvfp4_experts import NVFP4FusedExperts, NVFP4GroupedExperts
from fsdp_float8.fsdp.step import (
    Float8Step,
    StepPlan,
    float8_step,
    precompute_float8_dynamic_scale_for_fsdp,
    sync_float8_amax_and_scale_history,
)
from fsdp_float8.nn.convert import (
    ConversionReport,
    convert_to_float8_training,
    dims_divisible_by_16,
)
from fsdp_float8.nn.linear import Float8Linear
from fsdp_float8.nn.nvfp4_linear import NVFP4Config, NVFP4Linear, high_precision_ends
from fsdp_float8.tensor_parallel.input import PrepareFloat8ModuleInput
from fsdp_float8.tensor_parallel.styles import Float8ColwiseParallel, Float8RowwiseParallel
from fsdp_float8.tools.telemetry import Float8Telemetry
from fsdp_float8.weight_wrappers.base import _rebuild_weight_wrapper
from fsdp_float8.weight_wrappers.nvfp4 import NVFP4FSDPWeight
from fsdp_float8.weight_wrappers.wrap import (
    BlockFloat8Weight,
    DelayedFloat8Weight,
    DynamicFloat8Weight,
    StaticFloat8Weight,
)


def _old_wrapper_paths() -> list[tuple[Callable, str]]:
    """(object, its path under `fsdp_float8.weight_wrappers`): some checkpoints name these
    `fsdp_float8.fsdp.weight_wrappers.<module>.<name>`, a path that is no module."""
    objects: list[Callable] = [DynamicFloat8Weight, BlockFloat8Weight, DelayedFloat8Weight]
    objects += [StaticFloat8Weight, _rebuild_weight_wrapper]
    paths = [(o, f"{o.__module__}.{o.__qualname__}") for o in objects]
    return [(o, p.removeprefix("fsdp_float8.")) for o, p in paths]


# checkpoints holding these load with torch.load(weights_only=True); a weight wrapper
# pickles its config, so the config dataclasses and enums are safe globals too
_SAFE_GLOBALS: list[Callable | tuple[Callable, str]] = [
    Float8Tensor,
    _rebuild_float8_tensor,
    DynamicFloat8Weight,
    BlockFloat8Weight,
    DelayedFloat8Weight,
    StaticFloat8Weight,
    NVFP4FSDPWeight,
    _rebuild_weight_wrapper,
    Float8LinearConfig,
    NVFP4Config,
    CastConfig,
    DelayedScalingConfig,
    Float8GemmConfig,
    ScalingType,
    ScalingGranularity,
    Operand,
    Gemm,
]
# those names resolve from this table alone: torch.load(weights_only=True) imports nothing
_SAFE_GLOBALS += [(obj, f"fsdp_float8.fsdp.{path}") for obj, path in _old_wrapper_paths()]
torch.serialization.add_safe_globals(_SAFE_GLOBALS)

# torchao.float8 checkpoints (its float8 weight class pickled inside) load without torchao
import fsdp_float8.float8.checkpoint  # noqa: E402,F401  (registers stand-ins for its classes)

# name -> module of the optional features imported on first use (module __getattr__)
_LAZY = {
    "Float8ReduceScatter": "fsdp_float8.fsdp.reduce_scatter",
    "enable_float8_reduce_scatter": "fsdp_float8.fsdp.reduce_scatter",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'fsdp_float8' has no attribute {name!r}")
    try:
        module = importlib.import_module(_LAZY[name])
    except ImportError as e:
        raise ImportError(
            f"fsdp_float8.{name} needs a private torch API that this torch "
            f"({torch.__version__}) does not have: {e}. The rest of fsdp_float8 works; "
            "use FSDP2's own reduce-scatter (do not enable the float8 one) or a torch "
            "version that fsdp_float8 supports (2.11 to 2.15)"
        ) from e
    return getattr(module, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def _package_version() -> str:
    try:
        return importlib.metadata.version("fsdp_float8")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "0+unknown"


__version__ = _package_version()

__all__ = [
    "_auto_filter_for_recipe",
    "BlockFloat8Weight",
    "CastConfig",
    "ConversionReport",
    "DelayedFloat8Weight",
    "DelayedScalingConfig",
    "DynamicFloat8Weight",
    "ExpertCastPlan",
    "Float8FusedExperts",
    "Float8ColwiseParallel",
    "Float8ConfigError",
    "Float8GemmConfig",
    "Float8GroupedExperts",
    "Float8Linear",
    "Float8LinearConfig",
    "NVFP4Config",
    "NVFP4Linear",
    "NVFP4FusedExperts",
    "NVFP4GroupedExperts",
    "high_precision_ends",
    "Float8LinearRecipeName",
    "Float8RowwiseParallel",
    "Float8Step",
    "Float8Telemetry",
    "Float8Tensor",
    "Gemm",
    "Operand",
    "PrepareFloat8ModuleInput",
    "ScalingGranularity",
    "ScalingType",
    "StaticFloat8Weight",
    "StepPlan",
    "convert_to_float8_training",
    "dims_divisible_by_16",
    "export_state_dict",
    "float8_step",
    "float8_grouped_mm",
    "hp_to_float8",
    "precompute_float8_dynamic_scale_for_fsdp",
    "scaled_mm",
    "sqnr_db",
    "sync_float8_amax_and_scale_history",
]
