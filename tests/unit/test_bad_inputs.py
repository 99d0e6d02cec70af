"""Inputs at the edges: one token, 1-D and empty inputs give what nn.Linear
gives, for every recipe x scaling; a non-float input raises a TypeError as nn.Linear does."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fsdp_float8 import Float8Linear, Float8LinearConfig, sqnr_db
from fsdp_float8.core.numerics import SQNR_DB
from tests.unit.float8_helpers import IN_FEATURES, RECIPES, SCALINGS, make_config

# (input shape, what it is): nn.Linear takes any leading shape, including none and zero
EDGE_SHAPES = {
    "one_token": (1, IN_FEATURES),
    "one_token_3d": (1, 1, IN_FEATURES),
    "1d": (IN_FEATURES,),
    "empty": (0, IN_FEATURES),
    "empty_seq": (2, 0, IN_FEATURES),
}
BARS = (SQNR_DB["linear_output"], SQNR_DB["linear_grad_input"], SQNR_DB["linear_grad_weight"])


def _run(mod: nn.Module, x: torch.Tensor, grad_output: torch.Tensor):
    x = x.detach().clone().requires_grad_(True)
    out = mod(x)
    out.backward(grad_output)
    return out, x.grad, mod.weight.grad, mod.bias.grad


@pytest.mark.parametrize("emulate", [False, True], ids=["scaled_mm", "emulated"])
@pytest.mark.parametrize("shape", EDGE_SHAPES.values(), ids=EDGE_SHAPES.keys())
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_edge_shapes_match_nn_linear(recipe, scaling, shape, emulate) -> None:
    torch.manual_seed(0)
    ref = nn.Linear(IN_FEATURES, 48)
    mod = Float8Linear.from_float(copy.deepcopy(ref), make_config(recipe, scaling, emulate=emulate))
    x = torch.randn(shape)
    grad_output = torch.randn((*shape[:-1], 48))
    want, got = _run(ref, x, grad_output), _run(mod, x, grad_output)
    for name, w, g in zip(("output", "grad_input", "grad_weight", "grad_bias"), want, got):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert torch.isfinite(g).all(), name
    if x.numel() == 0:
        # nothing to multiply: nn.Linear gives empty outputs and all-zero weight gradients
        assert torch.equal(got[2], torch.zeros_like(got[2]))
        assert torch.equal(got[3], torch.zeros_like(got[3]))
        return
    for bar, w, g in zip(BARS, want, got):
        assert sqnr_db(w, g) >= bar


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float8_e4m3fn])
def test_non_float_input_raises_like_nn_linear(dtype: torch.dtype) -> None:
    x = torch.ones(2, IN_FEATURES).to(dtype)
    with pytest.raises(RuntimeError):
        nn.Linear(IN_FEATURES, 48)(x)  # what a user switching from nn.Linear gets today
    mod = Float8Linear.from_float(nn.Linear(IN_FEATURES, 48), Float8LinearConfig())
    with pytest.raises(TypeError, match=f"input has dtype {dtype}") as info:
        mod(x)
    assert "x.float()" in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_other_float_inputs_still_run(dtype: torch.dtype) -> None:
    hp = nn.Linear(IN_FEATURES, 48, dtype=dtype)  # the input's dtype, as nn.Linear needs
    mod = Float8Linear.from_float(hp, Float8LinearConfig(emulate=True))
    out = mod(torch.randn(4, IN_FEATURES).to(dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()


def _penalty_grad(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
    return g


def _float8_linear(recipe: str) -> nn.Module:
    return Float8Linear(64, 32, config=Float8LinearConfig.from_recipe_name(recipe))


def _nvfp4_linear() -> nn.Module:
    from fsdp_float8 import NVFP4Config, NVFP4Linear

    return NVFP4Linear(64, 32, config=NVFP4Config())


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 32, 64))

    def forward(self, x):
        from fsdp_float8.experts.gemm import ExpertCastPlan, float8_grouped_mm

        plan = ExpertCastPlan.from_config(Float8LinearConfig.from_recipe_name("rowwise"))
        offs = torch.tensor([8, x.shape[0]], dtype=torch.int32)
        return float8_grouped_mm(x, self.weight, offs, plan)


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: _float8_linear("tensorwise"), "Float8Linear"),
        (lambda: _float8_linear("rowwise"), "Float8Linear"),
        (_nvfp4_linear, "NVFP4Linear"),
        (_Experts, "float8 grouped experts"),
    ],
    ids=["tensorwise", "rowwise", "nvfp4", "experts"],
)
def test_double_backward_is_refused_naming_the_layer(make, name) -> None:
    # a gradient penalty differentiates the layer's backward: refused, not a constant
    torch.manual_seed(0)
    layer = make()
    x = torch.randn(16, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward") as err:
        _penalty_grad(layer, x)
    assert name in str(err.value) and str(tuple(layer.weight.shape)) in str(err.value)
    # a first-order gradient still runs
    (g,) = torch.autograd.grad(layer(x).square().sum(), x)
    assert g.shape == x.shape and not g.requires_grad
