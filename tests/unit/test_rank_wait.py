"""FSDP_FLOAT8_RANK_WAIT_S: how long a rank waits at a float8 refresh for the others. A value
that is not a finite number of seconds > 0 is a ValueError naming the variable and the range
(a negative one waited with no output, 0 failed a healthy run, nan/inf/abc gave errors that
did not name it); unset, the store's timeout applies."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from fsdp_float8.fsdp.rank_agreement import _wait_s


@pytest.mark.parametrize("text", ["-5", "0", "nan", "inf", "-inf", "abc", ""])
def test_a_bad_wait_is_refused_naming_the_variable(monkeypatch, text):
    monkeypatch.setenv("FSDP_FLOAT8_RANK_WAIT_S", text)
    with pytest.raises(ValueError) as e:
        _wait_s(dist.HashStore())
    msg = str(e.value)
    assert f"FSDP_FLOAT8_RANK_WAIT_S={text!r}" in msg and "finite number of seconds > 0" in msg


def test_a_good_wait_and_the_default(monkeypatch):
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=123))
    monkeypatch.delenv("FSDP_FLOAT8_RANK_WAIT_S", raising=False)
    assert _wait_s(store) == 123.0
    monkeypatch.setenv("FSDP_FLOAT8_RANK_WAIT_S", "2.5")
    assert _wait_s(store) == 2.5


def test_a_layer_converted_on_one_rank_only_is_told_without_every_config_field():
    # the ranks' fingerprints differ in `float8_layers`: the config fields of that layer
    # differ with it (one rank has no config there) and are not listed one by one
    from torch import nn

    from fsdp_float8 import Float8LinearConfig, convert_to_float8_training
    from fsdp_float8.fsdp.rank_agreement import check_agreement, fingerprint

    def weights(convert_b: bool):
        model = nn.ModuleDict({"a": nn.Linear(32, 32), "b": nn.Linear(32, 32)})
        keep = (lambda m, fqn: True) if convert_b else (lambda m, fqn: fqn != "b")
        config = Float8LinearConfig.from_recipe_name("tensorwise")
        convert_to_float8_training(model, config=config, module_filter_fn=keep)
        return [(fqn, m, "weight") for fqn, m in model.items()]

    rows = torch.stack([fingerprint(weights(True)), fingerprint(weights(False))])
    with pytest.raises(ValueError, match=r"float8_layers: ranks \[0\] vs \[1\]") as info:
        check_agreement(rows, None)
    message = str(info.value)
    assert "cast_config_input" not in message and "emulate" not in message
    assert "module_filter_fn" in message
