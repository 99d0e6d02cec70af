"""The extras lane fails a module that skips at collection, as it fails a test that skips
(tests/conftest.py): a module-level `pytest.importorskip` of a missing package drops the
whole file before any test exists. Elsewhere such a module is one skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_MODULES = {
    "importorskip": 'import pytest\n\npytest.importorskip("fsdp_float8_no_such_package")\n',
    "skip": 'import pytest\n\npytest.skip("no package", allow_module_level=True)\n',
}
_TEST = "\n\ndef test_never_collected():\n    pass\n"


@pytest.mark.parametrize("how", sorted(_MODULES))
@pytest.mark.parametrize("lane", ["0", "1"])
def test_a_collection_skip_fails_only_in_the_extras_lane(tmp_path: Path, lane, how) -> None:
    path = tmp_path / "test_skips_at_import.py"
    path.write_text(_MODULES[how] + _TEST)
    (tmp_path / "test_ok.py").write_text("def test_ok():\n    pass\n")  # the lane's other tests
    env = {**os.environ, "FSDP_FLOAT8_EXTRAS_LANE": lane}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest"]
    cmd += ["-o", "addopts=", "--rootdir", str(tmp_path), str(tmp_path)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    log = out.stdout + out.stderr
    if lane == "1":
        assert out.returncode != 0 and "1 error" in out.stdout, log
        assert "skipped at collection in the extras lane" in out.stdout, log
    else:
        assert out.returncode == 0 and "1 passed, 1 skipped" in out.stdout, log
