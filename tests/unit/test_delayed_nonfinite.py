"""Delayed scaling after a non-finite batch, in a training loop that skips a batch whose loss
is inf/NaN (the usual guard). The non-finite amaxes that batch recorded never enter the
amax history (they are counted per layer and operand, `nonfinite_amaxes`); its finite ones
count as a gradient-accumulation micro-batch's would. So after a NaN batch, whose recorded
amaxes are all NaN except the weights' (unchanged until the next forward), training goes on
bit for bit as if the batch had never been drawn; after an inf batch the poisoned operand's
history is the clean run's and every later loss is finite. The 2-rank FSDP2 case is in
tests/distributed/test_delayed_nonfinite.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fsdp_float8 import (
    CastConfig,
    DelayedScalingConfig,
    Float8LinearConfig,
    convert_to_float8_training,
    sync_float8_amax_and_scale_history,
)
from fsdp_float8.core.delayed_state import nonfinite_amaxes

DELAYED = CastConfig(scaling_type="delayed")
CONFIG = Float8LinearConfig(
    cast_config_input=DELAYED, cast_config_weight=DELAYED, cast_config_grad_output=DELAYED
)
STEPS, BAD_STEP = 12, 3


class _Residual(nn.Module):
    """A residual block: an inf in the input reaches the loss (the float8 cast saturates)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 32, bias=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return convert_to_float8_training(_Residual(), config=CONFIG)


def _batch(step: int, poison: float | None) -> torch.Tensor:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
    if poison is not None and step == BAD_STEP:
        x[3, 5] = poison
    return x


def _train(poison: float | None) -> tuple[list[float], nn.Module]:
    """The guarded loop: a non-finite loss skips backward and the optimizer step. Without
    `poison` the bad step's batch is never drawn (the reference run)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        if poison is None and step == BAD_STEP:
            continue
        loss = model(_batch(step, poison)).pow(2).mean()
        if not torch.isfinite(loss):
            opt.zero_grad()
            continue
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def _history(model: nn.Module, layer: str) -> torch.Tensor:
    return model.get_submodule(layer).delayed_scaling.fp8_amax_history_input


def test_a_skipped_nan_batch_leaves_no_trace() -> None:
    reference, ref_model = _train(None)
    losses, model = _train(math.nan)
    assert losses == reference  # bit for bit, every step after the skipped one
    for layer in ("mlp.0", "mlp.2"):
        assert torch.equal(_history(model, layer), _history(ref_model, layer)), layer


def test_a_skipped_inf_batch_never_enters_the_history() -> None:
    reference, ref_model = _train(None)
    for poison in (math.inf, -math.inf):
        losses, model = _train(poison)
        assert len(losses) == len(reference), poison  # no later step is skipped
        assert all(math.isfinite(v) for v in losses), (poison, losses)
        assert torch.equal(_history(model, "mlp.0"), _history(ref_model, "mlp.0")), poison


def test_nonfinite_amaxes_are_counted_per_layer_and_operand() -> None:
    # an inf saturates in the first layer's cast, so the second layer's input is finite;
    # a NaN stays NaN through both
    _, model = _train(math.inf)
    assert nonfinite_amaxes(model) == {"mlp.0.input": 1}
    _, model = _train(math.nan)
    assert nonfinite_amaxes(model) == {"mlp.0.input": 1, "mlp.2.input": 1}
    _, clean = _train(None)
    assert nonfinite_amaxes(clean) == {}


def _unguarded_steps(scale_fn_name: str, poison: float | None, steps: int) -> nn.Module:
    """Training without a residual: an inf in the batch saturates in the first layer's cast,
    so the loss stays finite and the step, with its sync, runs. At `BAD_STEP` the first
    layer's input records only a non-finite amax."""
    torch.manual_seed(0)
    config = Float8LinearConfig(
        cast_config_input=DELAYED,
        cast_config_weight=DELAYED,
        cast_config_grad_output=DELAYED,
        delayed_scaling_config=DelayedScalingConfig(scale_fn_name=scale_fn_name),
    )
    mlp = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 32, bias=False))
    model = convert_to_float8_training(mlp, config=config)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(steps):
        loss = model(_batch(step, poison)).pow(2).mean()
        assert torch.isfinite(loss), step
        loss.backward()
        opt.step()
        opt.zero_grad()
        sync_float8_amax_and_scale_history(model)
    return model


@pytest.mark.parametrize("scale_fn_name", ["max", "most_recent"])
def test_a_sync_after_only_nonfinite_amaxes_keeps_the_scale(scale_fn_name: str) -> None:
    """An operand that recorded no finite amax since the last sync has nothing to push: its
    history and scale stay the last sync's (an amax of 0 would give the largest scale, and
    the next step's cast of that operand would saturate everywhere)."""
    poisoned = _unguarded_steps(scale_fn_name, math.inf, BAD_STEP + 1)
    assert nonfinite_amaxes(poisoned) == {"0.input": 1}
    clean = _unguarded_steps(scale_fn_name, None, BAD_STEP)  # the steps before the bad one
    poisoned, before = (m.get_submodule("0").delayed_scaling for m in (poisoned, clean))
    assert torch.equal(poisoned.fp8_amax_history_input, before.fp8_amax_history_input)
    assert torch.equal(poisoned.fp8_scale_input, before.fp8_scale_input)
