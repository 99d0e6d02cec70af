"""torchao.float8's module tree, so code written for it runs by renaming `torchao` to
`fsdp_float8`: `from torchao.float8.float8_linear import Float8Linear` becomes
`from fsdp_float8.float8.float8_linear import Float8Linear`, and so on for `config`,
`float8_linear_utils`, `float8_tensor_parallel`, `fsdp_utils`, `float8_utils`,
`float8_scaling_utils`, `float8_training_tensor` and `distributed_utils`.

Every name is this package's own object (`fsdp_float8.float8.config.CastConfig is
fsdp_float8.CastConfig`). The few names of torchao 0.18 with no counterpart (the float8
inference API, `Float8TrainingTensor`, torchao's internal autograd functions) raise
`ImportError` naming the alternative; the whole list, checked against torchao 0.18, is in
docs/torchao.md. The names below load on first use, so importing one submodule does not
import the others. `checkpoint` (no torchao counterpart) loads torchao checkpoints.
"""

from __future__ import annotations

import importlib

# torchao.float8's top-level names -> the mirror submodule that holds them
_HOMES = {
    "CastConfig": "config",
    "Float8GemmConfig": "config",
    "Float8LinearConfig": "config",
    "Float8LinearRecipeName": "config",
    "ScalingGranularity": "config",
    "ScalingType": "config",
    "_auto_filter_for_recipe": "float8_linear_utils",
    "convert_to_float8_training": "float8_linear_utils",
    "precompute_float8_dynamic_scale_for_fsdp": "fsdp_utils",
    "GemmInputRole": "float8_training_tensor",
    "LinearMMConfig": "float8_training_tensor",
    "ScaledMMConfig": "float8_training_tensor",
}
# torchao.float8's top-level names with no counterpart (this face imports nothing of the
# package before a name is asked for: the messages of fsdp_float8.float8._absent, in short)
_ABSENT = {
    "FP8Granularity": "fsdp_float8 has no float8 inference API",
    "Float8MMConfig": "fsdp_float8 has no float8 inference API",
    "Float8TrainingTensor": "use fsdp_float8.Float8Tensor (see fsdp_float8.float8."
    "float8_training_tensor)",
}

__all__ = [
    "CastConfig",
    "Float8GemmConfig",
    "Float8LinearConfig",
    "Float8LinearRecipeName",
    "ScalingGranularity",
    "ScalingType",
    "_auto_filter_for_recipe",
    "convert_to_float8_training",
    "precompute_float8_dynamic_scale_for_fsdp",
]


def __getattr__(name: str) -> object:
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    if name in _ABSENT:
        raise ImportError(
            f"fsdp_float8.float8.{name} (torchao.float8.{name}) has no counterpart in "
            f"fsdp_float8: {_ABSENT[name]}"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
