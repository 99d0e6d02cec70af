"""Names of torchao.float8 that have no counterpart here, and the error that says so.

A mirror module lists its absent names with the alternative (`ABSENT` below) and installs
`module_getattr(__name__, absent)` as its module `__getattr__`: looking such a name up (an
import, an attribute) raises `ImportError` naming the alternative, since `from m import x`
would turn an `AttributeError` into a bare "cannot import name". Any other unknown name is
an ordinary `AttributeError`.
"""

from __future__ import annotations

from collections.abc import Callable

INFERENCE = (
    "fsdp_float8 is a training library and has no float8 inference API; "
    "export a plain high-precision checkpoint (fsdp_float8.export_state_dict) and quantize "
    "it with an inference stack"
)
TRAINING_TENSOR = (
    "use fsdp_float8.Float8Tensor (fields _data, _scale, _orig_dtype; built by "
    "fsdp_float8.float8.float8_training_tensor.hp_tensor_and_scale_to_float8 or "
    "fsdp_float8.hp_to_float8); fsdp_float8.float8.distributed_utils."
    "tensor_already_casted_to_fp8 tells a float8 tensor apart"
)
INTERNAL = "it is torchao's internal machinery; fsdp_float8's float8 layers do this inside"


def absent_error(module: str, name: str, remedy: str) -> ImportError:
    return ImportError(
        f"{module}.{name} (torchao.float8's {module.removeprefix('fsdp_float8.float8.')}."
        f"{name}) has no counterpart in fsdp_float8: {remedy}"
    )


def module_getattr(module: str, absent: dict[str, str]) -> Callable[[str], object]:
    def __getattr__(name: str) -> object:
        if name in absent:
            raise absent_error(module, name, absent[name])
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
