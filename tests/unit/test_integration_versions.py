"""The torchtitan integration pins torchtitan 0.3.x and says so, in every venv: with another
version or none, importing it raises UnsupportedTorchtitanVersion naming what was found and
the supported range, before anything of torchtitan is imported."""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys

import pytest

from fsdp_float8.integrations import (
    SUPPORTED_TORCHTITAN,
    UnsupportedTorchtitanVersion,
    check_torchtitan_version,
)


@pytest.mark.parametrize("found", ["0.3.0", "0.3.2", "0.3.1.dev20261001+cpu"])
def test_the_0_3_series_is_accepted(found: str) -> None:
    assert check_torchtitan_version(found) == found


@pytest.mark.parametrize("found", ["0.2.1", "0.4.0", "1.0.0", "nightly"])
def test_other_versions_are_refused_naming_found_and_supported(found: str) -> None:
    with pytest.raises(UnsupportedTorchtitanVersion) as err:
        check_torchtitan_version(found)
    assert f"torchtitan {found} is installed" in str(err.value)
    assert SUPPORTED_TORCHTITAN in str(err.value) and "pip install" in str(err.value)


def test_import_without_torchtitan_says_what_to_install(monkeypatch) -> None:
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    monkeypatch.delitem(sys.modules, "fsdp_float8.integrations.torchtitan", raising=False)
    with pytest.raises(UnsupportedTorchtitanVersion, match="torchtitan is not installed"):
        importlib.import_module("fsdp_float8.integrations.torchtitan")
    # a RuntimeError: torchtitan's --module loader swallows ImportError
    assert not issubclass(UnsupportedTorchtitanVersion, ImportError)


def test_the_library_imports_no_integration() -> None:
    code = "import sys, fsdp_float8; print(sorted(m for m in sys.modules if 'titan' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
