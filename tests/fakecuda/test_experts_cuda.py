"""Fake CUDA: the grouped expert GEMMs (`torch._scaled_grouped_mm`, SM90+) of a float8
expert projection, forward and backward, for the recipes experts take; torchtitan-style
`Float8GroupedExperts` (w1, w2, w3) end to end."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_float8 import Float8LinearConfig
from fsdp_float8.experts.gemm import ExpertCastPlan, float8_grouped_mm
from fsdp_float8.experts.modules import Float8GroupedExperts
from tests.fakecuda.cases import PARAMS
from tests.fakecuda.fake_cuda import B200, H200, backward, fake_cuda

pytestmark = pytest.mark.fakecuda
E, K, N = 4, 256, 128
# float8 grouped GEMMs per projection: rowwise_with_gw_hp runs grad_weight in high precision
SCALED_GROUPED = {"rowwise": 3, "rowwise_with_gw_hp": 2}
DEVICES = {"sm90": H200, "sm100": B200}


def _grouped(recipe: str, params: str, tokens: int):
    dtype, autocast = PARAMS[params]
    plan = ExpertCastPlan.from_config(Float8LinearConfig.from_recipe_name(recipe))
    with torch.device("cuda"):
        x = torch.randn(tokens, K, dtype=dtype, requires_grad=True)
        w = torch.randn(E, N, K, dtype=dtype, requires_grad=True)
        offs = torch.tensor([tokens // 4, tokens // 2, tokens // 2, tokens], dtype=torch.int32)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = float8_grouped_mm(x, w, offs, plan)
    assert out.shape == (tokens, N)
    backward(out.float().sum())
    assert x.grad.shape == x.shape and x.grad.dtype == dtype
    assert w.grad.shape == w.shape and w.grad.dtype == dtype


@pytest.mark.parametrize("dev", sorted(DEVICES))
@pytest.mark.parametrize("params", ["bf16", "fp32_autocast"])
@pytest.mark.parametrize("tokens", [64, 40], ids=["t64", "t40"])
@pytest.mark.parametrize("recipe", sorted(SCALED_GROUPED))
def test_grouped_expert_gemms(recipe, tokens, params, dev):
    with fake_cuda(DEVICES[dev]) as rules:
        _grouped(recipe, params, tokens)
    assert rules.calls["_scaled_grouped_mm"] == SCALED_GROUPED[recipe]


def test_tensorwise_experts_are_refused_with_a_remedy():
    # e5m2 grad_output: the grouped kernel takes e4m3 only
    with fake_cuda(H200), pytest.raises(ValueError, match="e4m3 operands"):
        _grouped("tensorwise", "bf16", 64)


class _TitanExperts(nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int, dtype: torch.dtype):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim, dtype=dtype))
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden, dtype=dtype))
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim, dtype=dtype))


@pytest.mark.parametrize("recipe", sorted(SCALED_GROUPED))
@pytest.mark.parametrize("fsdp_float8_all_gather", [False, True], ids=["plain", "wrapped"])
def test_titan_experts_module(recipe, fsdp_float8_all_gather):
    config = Float8LinearConfig.from_recipe_name(
        recipe, enable_fsdp_float8_all_gather=fsdp_float8_all_gather
    )
    with fake_cuda(H200) as rules:
        with torch.device("cuda"):
            experts = Float8GroupedExperts.from_experts(
                _TitanExperts(K, N, E, torch.bfloat16), config
            )
            x = torch.randn(64, K, dtype=torch.bfloat16, requires_grad=True)
            counts = torch.tensor([16, 0, 40, 8])
        backward(experts(x, counts).float().sum())
        assert x.grad.shape == x.shape
        assert all(getattr(experts, n).grad is not None for n in ("w1", "w2", "w3"))
    assert rules.calls["_scaled_grouped_mm"] == 3 * SCALED_GROUPED[recipe]
