"""torchao's pickled float8 weight unpickles to fsdp_float8's stand-in (committed fixture,
see tests/distributed/torchao_checkpoint_cases.py): `plain_state_dict` unwraps it to the
saved values exactly, ops on it give plain tensors, and saved again it holds no torchao
name. In a process that never imports torchao (a child here, with torchao made unimportable,
so the test holds whether or not torchao is installed: where it is imported, torch may pick
torchao's own registration for the name)."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import torch

from fsdp_float8.float8.checkpoint import TorchaoFloat8Weight, plain_state_dict
from fsdp_float8.float8.float8_training_tensor import LinearMMConfig
from tests.distributed.torchao_checkpoint_cases import FIXTURE


def test_torch_load_gives_stand_ins_that_unwrap_exactly() -> None:
    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys; sys.modules['torchao'] = None; "
        "from tests.unit.test_torchao_checkpoint_standin import check_stand_ins; "
        "check_stand_ins(); print('ok')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def check_stand_ins() -> None:
    assert "torchao" not in sys.modules or sys.modules["torchao"] is None
    state = torch.load(FIXTURE / "single.pt", weights_only=True)
    expected = torch.load(FIXTURE / "expected.pt", weights_only=True)
    weight = state["0.weight"]
    assert type(weight) is TorchaoFloat8Weight
    assert type(weight._linear_mm_config) is LinearMMConfig
    assert type(weight * 1) is torch.Tensor and torch.equal(weight * 1, weight._tensor)
    plain = plain_state_dict(state)
    assert all(type(v) is torch.Tensor for v in plain.values())
    for key, value in plain.items():
        assert torch.equal(value, expected[f"single.{key}"]), key
    buffer = io.BytesIO()
    torch.save(state, buffer)
    assert b"torchao" not in buffer.getvalue()
    again = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert type(again["0.weight"]) is torch.Tensor
    assert torch.equal(again["0.weight"], expected["single.0.weight"])
