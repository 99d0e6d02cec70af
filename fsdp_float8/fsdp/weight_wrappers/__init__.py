"""Deprecated path, kept for one release: the weight wrappers live in
`fsdp_float8.weight_wrappers` (a layer below `nn/` and `experts/`; `wrap.py` holds
`wrap_weight`). The submodules here (`base`, `dynamic`, `block`, ...) alias the new ones, so
a checkpoint pickled with the old class paths loads (with `weights_only=True` too: the old
names are registered as safe globals in `fsdp_float8/__init__.py`).

Importing this package warns once and re-exports the very objects of the new home.
"""

import warnings

from fsdp_float8.weight_wrappers.base import Float8WeightWrapper, plain_weight
from fsdp_float8.weight_wrappers.block import BlockFloat8Weight
from fsdp_float8.weight_wrappers.delayed import DelayedFloat8Weight
from fsdp_float8.weight_wrappers.dynamic import DynamicFloat8Weight
from fsdp_float8.weight_wrappers.static import StaticFloat8Weight
from fsdp_float8.weight_wrappers.wrap import (
    note_replaced,
    replaced_parameter,
    wrap_weight,
    wrapper_class,
)

__all__ = [
    "BlockFloat8Weight",
    "DelayedFloat8Weight",
    "DynamicFloat8Weight",
    "Float8WeightWrapper",
    "StaticFloat8Weight",
    "note_replaced",
    "plain_weight",
    "replaced_parameter",
    "wrap_weight",
    "wrapper_class",
]


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release: import from {new}",
        DeprecationWarning,
        stacklevel=3,
    )


_warn(__name__, "fsdp_float8.weight_wrappers.wrap")
