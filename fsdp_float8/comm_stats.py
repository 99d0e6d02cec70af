"""Deprecated path, kept for one release: the collective counter lives in
`fsdp_float8.tools.comm_stats`.

Importing this module warns once and re-exports the very objects of the new home. The
public import paths are listed in docs/torchao.md ("Public import paths").
"""

import warnings

from fsdp_float8.tools.comm_stats import CollectiveCounter, CollectiveKind, CollectiveRecord

__all__ = ["CollectiveCounter", "CollectiveKind", "CollectiveRecord"]

warnings.warn(
    "fsdp_float8.comm_stats is deprecated and will be removed in the next release: "
    "import from fsdp_float8.tools.comm_stats",
    DeprecationWarning,
    stacklevel=2,
)
