"""The trainer's mixture-of-experts block (`f8train.moe`): routed slots per expert and the
load-balancing loss, which reaches the router; `--recipe nvfp4 --preset moe_tiny` on 2
ranks converts the experts to NVFP4 experts and trains (finite losses)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from f8train.model import Transformer, model_args
from f8train.moe import MoEArgs, moe_aux_loss, tokens_per_expert
from tests.f8train.launch import metrics, output_of, train


def _moe_model(**moe):
    args = model_args("moe_tiny", n_layers=2, moe=MoEArgs(**{"hidden_dim": 128, **moe}))
    model = Transformer(args)
    model.init_weights(0)
    return model


def test_moe_aux_loss_and_tokens_per_expert():
    model = _moe_model(top_k=2)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    model(tokens)
    counts = tokens_per_expert(model)
    assert [sum(c) for c in counts] == [2 * 64, 2 * 64]  # every token routed to 2 experts
    aux = moe_aux_loss(model)
    # E * sum f_e p_e >= 1 with equality only when routing is perfectly balanced
    assert aux.item() >= 0.01 * 0.99
    aux.backward()
    assert model.blocks[0].feed_forward.router.grad.abs().sum() > 0


def test_nvfp4_recipe_trains_the_moe_preset_with_nvfp4_experts(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ("--preset", "moe_tiny", "--recipe", "nvfp4", "--steps", "3", "--val-every", "0")
    result = train(out, *args, "--ckpt-every", "0")
    assert result.returncode == 0, output_of(result)
    assert "converted 2 expert modules" in result.stdout, result.stdout
    losses = [m["loss"] for m in metrics(out) if "loss" in m]
    assert len(losses) >= 2 and all(math.isfinite(v) for v in losses), losses
