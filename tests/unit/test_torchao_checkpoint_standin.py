"""torchao's pickled float8 weight unpickles to fsdp_float8's stand-in (committed fixture,
see tests/distributed/torchao_checkpoint_cases.py): `plain_state_dict` unwraps it to the
saved values exactly, ops on it give plain tensors, and saved again it holds no torchao
name."""

from __future__ import annotations

import io

import torch

from fsdp_float8.float8.checkpoint import TorchaoFloat8Weight, plain_state_dict
from fsdp_float8.float8.float8_training_tensor import LinearMMConfig
from tests.distributed.torchao_checkpoint_cases import FIXTURE


def test_torch_load_gives_stand_ins_that_unwrap_exactly() -> None:
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
