"""Float8Linear numerics: SQNR of the three GEMMs against float32 for every recipe x scaling
(dynamic, delayed, static) x emulate x dtype, real torch._scaled_mm against its emulation,
padding, autocast and no-grad forwards. Inputs are (batch, seq, features)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_float8 import (
    Float8Linear,
    Float8LinearConfig,
    Float8LinearRecipeName,
    Float8Tensor,
    Operand,
    sqnr_db,
)
from fsdp_float8.core.numerics import SQNR_DB
from tests.unit.float8_helpers import (
    RECIPES,
    SCALINGS,
    make_batch,
    make_config,
    make_linear,
    reference,
    run_linear,
    warm_up,
)

DTYPES = (torch.float32, torch.bfloat16)
BARS = {
    "output": SQNR_DB["linear_output"],
    "grad_input": SQNR_DB["linear_grad_input"],
    "grad_weight": SQNR_DB["linear_grad_weight"],
}


def _assert_sqnr(want, got, context: str) -> None:
    for name, w, g in zip(BARS, want, got):
        sqnr = sqnr_db(w, g)
        assert sqnr >= BARS[name], f"{context}: {name} SQNR {sqnr:.1f} dB < {BARS[name]} dB"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("emulate", [False, True], ids=["scaled_mm", "emulated"])
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_linear_sqnr(recipe: str, scaling: str, emulate: bool, dtype: torch.dtype) -> None:
    mod = make_linear(make_config(recipe, scaling, emulate=emulate), dtype)
    if scaling == "delayed":
        warm_up(mod)
        assert mod.delayed_scaling.ready
    x, grad_output = make_batch(dtype, seed=7)
    got = run_linear(mod, x, grad_output)
    assert got[0].shape == (*x.shape[:-1], mod.out_features)
    assert all(t.dtype == dtype for t in got)
    _assert_sqnr(reference(mod, x, grad_output), got, f"{recipe}/{scaling}/{dtype}")


def test_grid_really_uses_the_requested_scaling() -> None:
    """Guards the grid above: delayed configs create state, static ones use the given scale."""
    assert make_linear(make_config("tensorwise", "delayed")).delayed_scaling.operands == tuple(
        Operand
    )
    for recipe in ("rowwise", "rowwise_with_gw_hp"):
        assert make_linear(make_config(recipe, "delayed")).delayed_scaling.operands == (
            Operand.WEIGHT,
        )
    # a static weight scale 1000x too large saturates and must wreck the output
    bad = make_config("tensorwise", "static")
    w_cfg = bad.cast_config_weight
    from dataclasses import replace

    bad = replace(bad, cast_config_weight=replace(w_cfg, static_scale=w_cfg.static_scale * 1e3))
    x, grad_output = make_batch(torch.float32, seed=7)
    mod = make_linear(bad)
    out = run_linear(mod, x, grad_output)[0]
    assert sqnr_db(reference(mod, x, grad_output)[0], out) < SQNR_DB["linear_output"]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_scaled_mm_matches_emulation(recipe: str, scaling: str, dtype: torch.dtype) -> None:
    results = []
    for emulate in (False, True):
        mod = make_linear(make_config(recipe, scaling, emulate=emulate), dtype)
        if scaling == "delayed":
            warm_up(mod)
        results.append(run_linear(mod, *make_batch(dtype, seed=7)))
    for name, real, emulated in zip(BARS, *results):
        sqnr = sqnr_db(emulated, real)
        assert sqnr >= SQNR_DB["real_vs_emulated"], f"{name}: {sqnr:.1f} dB"


@pytest.mark.parametrize("recipe", RECIPES)
def test_dims_not_multiple_of_16_need_pad_inner_dim(recipe: str) -> None:
    for dims in ((60, 48), (64, 40)):
        with pytest.raises(ValueError, match=r"pad_inner_dim=True") as info:
            Float8Linear(*dims, config=Float8LinearConfig.from_recipe_name(recipe))
        assert f"Float8Linear({dims[0]}, {dims[1]})" in str(info.value)
    for emulate in (False, True):
        config = Float8LinearConfig.from_recipe_name(recipe, pad_inner_dim=True, emulate=emulate)
        mod = make_linear(config, in_features=60, out_features=40)
        x, grad_output = make_batch(torch.float32, seed=3, in_features=60, out=40)
        _assert_sqnr(reference(mod, x, grad_output), run_linear(mod, x, grad_output), recipe)


@pytest.mark.parametrize("recipe", RECIPES)
def test_autocast_bf16_forward(recipe: str) -> None:
    mod = make_linear(Float8LinearConfig.from_recipe_name(recipe))  # float32 parameters
    x, grad_output = make_batch(torch.float32, seed=5)
    x.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mod(x)
    assert out.dtype == torch.bfloat16
    out.backward(grad_output.to(torch.bfloat16))
    assert x.grad.dtype == torch.float32 and mod.weight.grad.dtype == torch.float32
    want = reference(mod, x.detach().to(torch.bfloat16), grad_output)
    _assert_sqnr(want, (out.detach(), x.grad, mod.weight.grad), f"autocast {recipe}")


@pytest.mark.parametrize("recipe", RECIPES)
def test_no_grad_and_inference_mode_forwards(recipe: str) -> None:
    mod = make_linear(Float8LinearConfig.from_recipe_name(recipe))
    x, _ = make_batch(torch.float32, seed=5)
    expected = mod(x).detach()
    with torch.no_grad():
        no_grad = mod(x)
    with torch.inference_mode():
        inference = mod(x)
    assert not no_grad.requires_grad and inference.is_inference()
    torch.testing.assert_close(no_grad, expected, rtol=0, atol=0)
    torch.testing.assert_close(inference, expected, rtol=0, atol=0)


def test_from_float_shares_parameters_and_bias_gets_grad() -> None:
    hp = nn.Linear(64, 48)
    mod = Float8Linear.from_float(hp, Float8LinearConfig())
    assert mod.weight is hp.weight and mod.bias is hp.bias
    x, grad_output = make_batch(torch.float32, seed=1)
    mod(x).backward(grad_output)
    torch.testing.assert_close(hp.bias.grad, grad_output.sum((0, 1)))
    with pytest.raises(TypeError, match="nn.Linear"):
        Float8Linear.from_float(nn.Conv1d(4, 4, 1))


FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _saved_float8(mod: nn.Module, x: torch.Tensor) -> list[bool]:
    """For each tensor autograd saves in a forward: does it hold float8 data?"""
    saved: list[bool] = []

    def pack(t):
        data = t._data if isinstance(t, Float8Tensor) else t
        saved.append(data.dtype in FLOAT8_DTYPES)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mod(x)
    return saved


def test_save_input_in_float8_same_grads_and_saves_float8() -> None:
    x, grad_output = make_batch(torch.float32, seed=2)
    results, saved = [], []
    for keep in (False, True):
        mod = make_linear(Float8LinearConfig(save_input_in_float8=keep))
        results.append(run_linear(mod, x, grad_output))
        saved.append(_saved_float8(mod, x.clone().requires_grad_()))
    # the forward's tensorwise input cast is exactly the one grad_weight takes, so backward
    # keeps it (flag or not) instead of the high-precision input
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(saved[0]) and any(saved[1])


def test_extra_repr_names_the_casts() -> None:
    text = repr(make_linear(Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp")))
    assert text == (
        "Float8Linear(in_features=64, out_features=48, bias=True, cast_configs=i:dyn_axs_e4m3,"
        "w:dyn_axs_e4m3,go:dyn_axs_e4m3,i_gw:dis_ten_e4m3,w_gi:dyn_ten_e4m3,go_gw:dis_ten_e4m3)"
    )
    delayed = make_linear(make_config("tensorwise", "delayed"))
    assert delayed.extra_repr().endswith(
        "cast_configs=i:del_ten_e4m3,w:del_ten_e4m3,go:del_ten_e5m2"
    )


@pytest.mark.parametrize("recipe", [r.value for r in Float8LinearRecipeName])
def test_input_dtype_must_match_the_weight_as_in_nn_linear(recipe: str) -> None:
    """nn.Linear refuses an input whose dtype is not the weight's; so does Float8Linear
    (outside autocast), instead of silently returning the input's dtype."""
    config = Float8LinearConfig.from_recipe_name(recipe, emulate=True)
    for weight_dtype, x_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        mod = make_linear(config, weight_dtype, in_features=64, out_features=64)
        x = torch.randn(4, 64, dtype=x_dtype)
        with pytest.raises(RuntimeError, match="same dtype"):
            nn.functional.linear(x, mod.weight.detach())  # what nn.Linear does
        with pytest.raises(TypeError) as info:
            mod(x)
        text = str(info.value)
        assert str(x_dtype) in text and str(weight_dtype) in text
        assert "torch.autocast" in text and f"x.to({weight_dtype})" in text
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast picks the dtype
            assert mod(x).dtype == torch.bfloat16
