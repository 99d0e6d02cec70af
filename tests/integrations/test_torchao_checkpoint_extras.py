"""A checkpoint torchao.float8 writes now (2 gloo ranks, float8 all-gather) loads into a
model converted with fsdp_float8, exactly, in fresh processes that never import torchao
(the committed fixture's test, tests/distributed/test_torchao_checkpoint.py, on a checkpoint
made by the installed torchao)."""

from __future__ import annotations

import pytest

from tests.distributed.launcher import run_distributed
from tests.distributed.test_torchao_checkpoint import check_loaded
from tests.distributed.torchao_checkpoint_cases import (
    load_with_fsdp_float8,
    write_torchao_checkpoint,
)

pytestmark = pytest.mark.extras


def test_fresh_torchao_checkpoint_loads_exactly_without_torchao(tmp_path):
    pytest.importorskip("torchao.float8")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    run_distributed(write_torchao_checkpoint, 2, tmp_path / "w", str(ckpt), timeout_s=300)
    assert (ckpt / "dcp" / ".metadata").exists() and (ckpt / "single.pt").exists()
    check_loaded(
        run_distributed(load_with_fsdp_float8, 2, tmp_path / "l", str(ckpt), timeout_s=240)
    )
