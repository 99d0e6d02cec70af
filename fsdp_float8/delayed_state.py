"""Deprecated path, kept for one release: the delayed-scaling state lives in
`fsdp_float8.core.delayed_state`, and `export_state_dict` is exported by `fsdp_float8`.

Importing this module warns once and re-exports the very objects of the new home. The
public import paths are listed in docs/torchao.md ("Public import paths").
"""

import warnings

from fsdp_float8.core.delayed_state import DelayedScalingState, DelayedState, export_state_dict

__all__ = ["DelayedScalingState", "DelayedState", "export_state_dict"]

warnings.warn(
    "fsdp_float8.delayed_state is deprecated and will be removed in the next release: "
    "import from fsdp_float8.core.delayed_state (export_state_dict also from fsdp_float8)",
    DeprecationWarning,
    stacklevel=2,
)
