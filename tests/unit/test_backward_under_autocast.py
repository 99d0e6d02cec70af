"""A float8 layer's gradients do not depend on where `.backward()` runs or on tracing: with
float32 parameters under autocast, its high-precision and emulated GEMMs (and CPU float8
GEMMs) run outside autocast, as its forward's do, eager and compiled."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from fsdp_float8 import Float8Linear, Float8LinearConfig
from fsdp_float8.core._compat import cpu_scaled_mm_takes_row_scales

# (recipe, emulate): torch 2.11's CPU float8 GEMM takes no row scales, so rowwise emulates
CASES = [
    ("tensorwise", False),
    ("tensorwise", True),
    ("rowwise", True),
    ("rowwise_with_gw_hp", True),
    ("rowwise_with_gw_hp", not cpu_scaled_mm_takes_row_scales()),
]


def _grads(layer: nn.Module, x0: torch.Tensor, backward_inside: bool):
    x = x0.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        y = layer(x)
        if backward_inside:
            y.float().square().sum().backward()
    if not backward_inside:
        y.float().square().sum().backward()
    grads = (x.grad, layer.weight.grad)
    layer.weight.grad = None
    return grads


@pytest.mark.parametrize("recipe, emulate", CASES, ids=str)
def test_gradients_do_not_depend_on_where_backward_runs(recipe, emulate):
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    torch.manual_seed(0)
    layer = Float8Linear.from_float(nn.Linear(64, 48, bias=False), config=config)
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(layer), backend="aot_eager", fullgraph=True)
    x = torch.randn(32, 64)
    outside = _grads(layer, x, backward_inside=False)
    assert outside[1].dtype == torch.float32
    for run, grads in (
        ("eager, inside", _grads(layer, x, backward_inside=True)),
        ("compiled, outside", _grads(compiled, x, backward_inside=False)),
        ("compiled, inside", _grads(compiled, x, backward_inside=True)),
    ):
        for a, b in zip(outside, grads, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), run
