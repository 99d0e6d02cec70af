"""`import fsdp_float8` survives a torch that renamed a private API used by one optional
feature; the package has no numpy dependency; `fsdp_float8.__version__`."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import fsdp_float8

ROOT = Path(__file__).resolve().parents[2]

# Simulates a torch whose FSDP2 private module no longer has `ReduceScatter`: the real
# module is imported first (FSDP2 itself needs it), then replaced by one without it.
_RENAMED_API = """
import sys, types
import torch.distributed.fsdp
name = "torch.distributed.fsdp._fully_shard._fsdp_api"
sys.modules[name] = types.ModuleType(name)
import fsdp_float8
from fsdp_float8 import Float8LinearConfig, convert_to_float8_training
print("imported", fsdp_float8.__version__)
try:
    fsdp_float8.enable_float8_reduce_scatter
except ImportError as e:
    print("feature error:", e)
"""


def test_import_works_when_the_private_reduce_scatter_api_is_gone() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _RENAMED_API],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "imported" in out.stdout
    error = out.stdout.split("feature error:", 1)[1]
    assert "fsdp_float8.enable_float8_reduce_scatter needs a private torch API" in error
    assert "ReduceScatter" in error and "The rest of fsdp_float8 works" in error


def test_optional_features_still_import_lazily() -> None:
    from fsdp_float8 import Float8ReduceScatter, enable_float8_reduce_scatter
    from fsdp_float8.fsdp.reduce_scatter import Float8ReduceScatter as direct

    assert Float8ReduceScatter is direct and callable(enable_float8_reduce_scatter)
    assert "enable_float8_reduce_scatter" in dir(fsdp_float8)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        fsdp_float8.nope  # noqa: B018


def test_numpy_is_not_a_runtime_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("numpy")]
    assert any(d.startswith("numpy") for d in project["optional-dependencies"]["f8train"])


def test_version_from_package_metadata_with_a_fallback(monkeypatch) -> None:
    assert fsdp_float8.__version__ == importlib.metadata.version("fsdp_float8")

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert fsdp_float8._package_version() == "0+unknown"
