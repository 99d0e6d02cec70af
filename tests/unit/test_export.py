"""Exporting a trained float8 model: plain weights that load strictly into the original."""

from __future__ import annotations

import copy
import io
from dataclasses import replace

import pytest
import torch
from torch import nn

from fsdp_float8 import convert_to_float8_training, export_state_dict, sqnr_db
from fsdp_float8.core.numerics import SQNR_DB
from tests.unit.float8_helpers import make_config


def _trained(config):
    torch.manual_seed(0)
    original = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32))
    model = convert_to_float8_training(copy.deepcopy(original), config=config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return original, model


@pytest.mark.parametrize("all_gather", [False, True], ids=["plain", "fp8_all_gather"])
def test_export_loads_strictly_into_the_unconverted_model(all_gather: bool) -> None:
    config = replace(make_config("tensorwise", "delayed"), enable_fsdp_float8_all_gather=all_gather)
    original, model = _trained(config)
    training = model.state_dict()  # a training checkpoint keeps the delayed state
    assert any("fp8_amax_history" in k for k in training)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        copy.deepcopy(original).load_state_dict(training, strict=True)

    exported = export_state_dict(model)
    buffer = io.BytesIO()
    torch.save(exported, buffer)
    buffer.seek(0)
    original.load_state_dict(torch.load(buffer, weights_only=True), strict=True)
    for (name, p), q in zip(original.named_parameters(), model.parameters(), strict=True):
        assert type(p.data) is torch.Tensor, name
        assert torch.equal(p, q.detach()), name  # the trained weights (wrapper stripped)
    x = torch.randn(4, 64)  # the same model, in high precision vs float8
    assert sqnr_db(original(x), model.eval()(x)) >= SQNR_DB["linear_output"]


def test_export_of_a_full_state_dict_given() -> None:
    _, model = _trained(make_config("tensorwise", "delayed"))
    full = {f"module.{k}": v for k, v in model.state_dict().items()}  # e.g. a wrapper's keys
    assert set(export_state_dict(model, full)) == {
        f"module.{k}" for k in ("0.weight", "0.bias", "2.weight", "2.bias")
    }
