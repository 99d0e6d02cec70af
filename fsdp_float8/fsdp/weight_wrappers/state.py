"""Deprecated path, kept for one release: this module lives in
`fsdp_float8.weight_wrappers.state`. Checkpoints saved with `torch.save` before the move name
its classes by this path; loading one imports this alias, which gives the very objects of the
new home (see `fsdp_float8.fsdp.weight_wrappers`).
"""

from fsdp_float8.fsdp.weight_wrappers import _warn
from fsdp_float8.weight_wrappers.state import WeightState, written_args

__all__ = ["WeightState", "written_args"]

_warn(__name__, "fsdp_float8.weight_wrappers.state")
