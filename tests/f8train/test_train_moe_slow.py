"""100 steps of ``--preset moe_tiny`` (slow): float8 (rowwise, float8 all-gather of the
attention, shared-expert and expert weights) against the bf16 baseline on the same data."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.f8train.test_train_slow import _val_losses

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1800)  # two 100-step MoE runs: ~290 s idle, over the 300 s default
def test_moe_tiny_float8_val_loss_within_1_percent_of_bf16(tmp_path: Path) -> None:
    moe = ("--preset", "moe_tiny")
    runs = {
        "bf16": (*moe, "--recipe", "off"),
        "fp8": (*moe, "--recipe", "rowwise", "--fp8-all-gather"),
    }
    v = _val_losses(tmp_path, runs)
    print(f"moe_tiny val loss after 100 steps: bf16 {v['bf16']:.4f}, float8 {v['fp8']:.4f}")
    assert math.isfinite(v["fp8"]) and abs(v["fp8"] - v["bf16"]) / v["bf16"] < 0.01
