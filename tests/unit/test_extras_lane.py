"""The extras lane turns a skip into a failure (tests/conftest.py), and only there: a test
marked `extras` whose package is missing skips under `make test` and fails under
FSDP_FLOAT8_EXTRAS_LANE=1, where every optional package should be installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_MISSING = """
import pytest

@pytest.mark.extras
def test_needs_a_missing_package():
    pytest.importorskip("fsdp_float8_no_such_package")
"""


@pytest.mark.parametrize("lane", ["0", "1"])
def test_a_skip_fails_only_in_the_extras_lane(tmp_path: Path, lane: str) -> None:
    path = tmp_path / "test_missing.py"
    path.write_text(_MISSING)
    env = {**os.environ, "FSDP_FLOAT8_EXTRAS_LANE": lane}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest"]
    cmd += ["-o", "addopts=", "--rootdir", str(tmp_path), str(path)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    if lane == "1":
        assert out.returncode == 1 and "1 failed" in out.stdout, out.stdout + out.stderr
        assert "skipped in the extras lane" in out.stdout
    else:
        assert out.returncode == 0 and "1 skipped" in out.stdout, out.stdout + out.stderr


def test_the_lane_pins_every_extra_and_torch() -> None:
    pins = (ROOT / ".ci" / "extras.txt").read_text().split("\n")
    pinned = dict(line.split("==") for line in pins if line and not line.startswith("#"))
    assert set(pinned) == {"torchao", "transformers", "torchtitan", "accelerate", "matplotlib"}
    assert (ROOT / ".ci" / "torch-pin.txt").read_text().strip().endswith("torch==2.13.0")
