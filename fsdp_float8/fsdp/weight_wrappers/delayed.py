"""Deprecated path, kept for one release: this module lives in
`fsdp_float8.weight_wrappers.delayed`. Checkpoints saved with `torch.save` before the move name
its classes by this path; loading one imports this alias, which gives the very objects of the
new home (see `fsdp_float8.fsdp.weight_wrappers`).
"""

from fsdp_float8.fsdp.weight_wrappers import _warn
from fsdp_float8.weight_wrappers.delayed import DelayedFloat8Weight

__all__ = ["DelayedFloat8Weight"]

_warn(__name__, "fsdp_float8.weight_wrappers.delayed")
