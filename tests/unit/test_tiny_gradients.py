"""Tiny gradients keep their precision in every recipe.

A loss scaled far down (or a layer deep in a network) gives grad_output values many orders of
magnitude below 1. A float8 cast scales each tensor, row or block by fp8_max / amax, so the
magnitude itself should not matter: the SQNR of grad_input and grad_weight must stay at the
bar of ordinary inputs down to the float32 normal range. The only limit is the largest scale,
2^126 (its inverse is the smallest normal float32 and an e8m0 factor, `MAX_SCALE`).
"""

from __future__ import annotations

import pytest
import torch

from fsdp_float8 import Float8Linear, Float8LinearConfig, sqnr_db
from fsdp_float8.core.config import E4M3, E5M2
from fsdp_float8.core.numerics import SQNR_DB
from fsdp_float8.core.payload import e8m0_from_scale, scale_from_e8m0
from fsdp_float8.core.scaling import MAX_SCALE, amax_to_scale, float8_max
from tests.unit.float8_helpers import make_config

M, K, N = 32, 256, 64
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8")
# 1e-20: a tiny loss scale; 1e-36: below e4m3's fp8_max * 2^-126 (5.3e-36), where the scale
# stops growing at MAX_SCALE, yet still a normal float32 (>= 1.2e-38), so the float8 values
# keep e4m3's and e5m2's normal precision (1e-36 * 2^126 = 85)
TINY = (1e-20, 1e-36)


def _grads(config: Float8LinearConfig, scale: float):
    torch.manual_seed(0)
    mod = Float8Linear(K, N, bias=False, config=config)
    x = torch.randn(M, K, requires_grad=True)
    grad_out = torch.randn(M, N) * scale
    mod(x).backward(grad_out)
    w64, go64 = mod.weight.detach().double(), grad_out.double()
    return (x.grad, go64 @ w64), (mod.weight.grad, go64.T @ x.detach().double())


@pytest.mark.parametrize("scale", TINY, ids=("1e-20", "1e-36"))
@pytest.mark.parametrize("recipe", (*RECIPES, "delayed"))
def test_tiny_grad_output_keeps_sqnr(recipe: str, scale: float) -> None:
    config = (
        make_config("tensorwise", "delayed")
        if recipe == "delayed"
        else Float8LinearConfig.from_recipe_name(recipe)
    )
    (gi, gi_ref), (gw, gw_ref) = _grads(config, scale)
    assert gi.abs().max() > 0 and gw.abs().max() > 0, "the gradients underflowed to zero"
    assert sqnr_db(gi_ref, gi) >= SQNR_DB["linear_grad_input"]
    assert sqnr_db(gw_ref, gw) >= SQNR_DB["linear_grad_weight"]


# the recipes with power-of-two scales (float32 scales of c * x round unlike those of x)
POW2_RECIPES = [
    r for r in RECIPES if Float8LinearConfig.from_recipe_name(r).round_scales_to_power_of_2
]


@pytest.mark.parametrize("recipe", POW2_RECIPES)
def test_tiny_and_unit_grad_output_cast_alike(recipe: str) -> None:
    """Power-of-two scales make the float8 cast of c * x that of x for c = 2^-66 (~1e-20),
    exactly: the gradients are those of a unit grad_output times c, bit for bit."""
    config = Float8LinearConfig.from_recipe_name(recipe)
    c = 2.0**-66
    (gi, _), (gw, _) = _grads(config, c)
    (gi1, _), (gw1, _) = _grads(config, 1.0)
    torch.testing.assert_close(gi, gi1 * c, rtol=0, atol=0)
    torch.testing.assert_close(gw, gw1 * c, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_scale_stops_at_max_scale(dtype) -> None:
    """Below amax = fp8_max / MAX_SCALE (and at amax 0) the scale is MAX_SCALE: finite, its
    inverse a normal float32, and exact as e8m0 (the MX scale format)."""
    floor = float8_max(dtype) / MAX_SCALE
    amax = torch.tensor([0.0, floor / 4, floor, floor * 4], dtype=torch.float32)
    scale = amax_to_scale(amax, dtype)
    assert scale.tolist()[:3] == [MAX_SCALE] * 3 and scale[3] == MAX_SCALE / 4
    assert scale.reciprocal().min() >= torch.finfo(torch.float32).tiny
    pow2 = amax_to_scale(amax, dtype, power_of_2=True)
    assert torch.equal(scale_from_e8m0(e8m0_from_scale(pow2)), pow2)
