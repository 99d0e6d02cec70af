"""The float8 step per model part (pipeline stages, torchtitan's `model_parts`): each part
holding float8 layers gets its own step, refreshed after its own optimizer's step; a part
holding none gets none. Layers are built directly (as torchtitan builds them from configs),
so no step exists until `enable_float8_steps`; torchtitan's `float8_post_optimizer_build`
is this call. The 4-rank pipeline runs are in tests/distributed/test_pipeline_parallel.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_float8 import CastConfig, Float8Linear, Float8LinearConfig
from fsdp_float8.integrations.model_parts import enable_float8_steps

DELAYED = CastConfig(scaling_type="delayed")
CONFIG = Float8LinearConfig(
    cast_config_input=DELAYED, cast_config_weight=DELAYED, cast_config_grad_output=DELAYED
)


def _stage(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        Float8Linear(32, 64, bias=False, config=CONFIG),
        nn.ReLU(),
        Float8Linear(64, 32, bias=False, config=CONFIG),
    )


def _syncs(part: nn.Module) -> list[int]:
    return [m.delayed_scaling.syncs for m in part.modules() if isinstance(m, Float8Linear)]


def _train_step(parts: list[nn.Module], opts: list[torch.optim.Optimizer]) -> list[list[int]]:
    """One pipeline step by hand; each part's syncs seen right after each optimizer step."""
    x = torch.randn(8, 32)
    for part in parts:
        x = part(x)
    x.float().pow(2).mean().backward()
    seen = []
    for opt in opts:
        opt.step()
        opt.zero_grad()
        seen.append([s for p in parts[:2] for s in _syncs(p)])
    return seen


def test_each_part_gets_its_own_step() -> None:
    head = nn.Linear(32, 32, bias=False)  # a stage left in high precision
    parts = [_stage(0), _stage(1), head]
    opts = [torch.optim.AdamW(p.parameters(), lr=1e-2) for p in parts]
    # no step yet: optimizer steps refresh nothing
    assert _train_step(parts, opts)[-1] == [0, 0, 0, 0]
    steps = enable_float8_steps(parts)
    assert [s.model for s in steps] == parts[:2]
    assert all(s.enabled for s in steps)
    # each part's delayed state syncs after its own optimizer's step, not its neighbour's
    assert _train_step(parts, opts) == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert enable_float8_steps(parts) == steps  # idempotent


def test_parts_must_be_modules() -> None:
    with pytest.raises(TypeError, match=r"model_parts\[1\] is a str"):
        enable_float8_steps([_stage(0), "stage1"])
    part = _stage(0)
    assert [s.model for s in enable_float8_steps(part)] == [part]
