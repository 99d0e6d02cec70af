"""Integrations with training frameworks, each imported only when used.

`fsdp_float8.integrations.torchtitan` needs torchtitan 0.3.x. This package itself imports
nothing but the standard library, so the library still needs torch only; the version check
lives here so that it can run (and be tested) without torchtitan.
"""

from __future__ import annotations

import importlib.metadata
import re

SUPPORTED_TORCHTITAN = "torchtitan>=0.3.0,<0.4"
_SUPPORTED_MINOR = (0, 3)


class UnsupportedTorchtitanVersion(RuntimeError):
    """torchtitan is missing or outside the range this integration supports."""


def check_torchtitan_version(found: str | None = None) -> str:
    """The installed torchtitan version, or an `UnsupportedTorchtitanVersion` naming what was
    found and what is supported (a RuntimeError, so torchtitan's `--module` loader, which
    swallows ImportError, shows it)."""
    if found is None:
        try:
            found = importlib.metadata.version("torchtitan")
        except importlib.metadata.PackageNotFoundError:
            raise UnsupportedTorchtitanVersion(
                f"torchtitan is not installed; fsdp_float8.integrations.torchtitan supports "
                f"{SUPPORTED_TORCHTITAN}. Install it: pip install '{SUPPORTED_TORCHTITAN}'"
            ) from None
    match = re.match(r"(\d+)\.(\d+)", found)
    if match is None or (int(match[1]), int(match[2])) != _SUPPORTED_MINOR:
        raise UnsupportedTorchtitanVersion(
            f"torchtitan {found} is installed; fsdp_float8.integrations.torchtitan supports "
            f"{SUPPORTED_TORCHTITAN} only (the config-tree API it plugs into changed before "
            f"0.3 and may change after). Install a supported one: pip install "
            f"'{SUPPORTED_TORCHTITAN}', or convert a built model yourself with "
            "fsdp_float8.convert_to_float8_training"
        )
    return found
