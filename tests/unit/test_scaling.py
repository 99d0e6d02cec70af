"""Scale math and strategies: cast SQNR per dtype and granularity, power-of-2 rounding,
amax == 0, saturation, and the GEMM of two float8 tensors."""

from __future__ import annotations

import pytest
import torch

from fsdp_float8 import Float8Linear, Float8LinearConfig, hp_to_float8, scaled_mm, sqnr_db
from fsdp_float8.core._compat import cpu_scaled_mm_takes_row_scales
from fsdp_float8.core.config import E4M3, E5M2
from fsdp_float8.core.delayed_state import DelayedState
from fsdp_float8.core.gemm import row_scaled_mm_around_unit_gemm
from fsdp_float8.core.gemms import Gemm, Operand
from fsdp_float8.core.numerics import SQNR_DB, saturation_fraction, underflow_fraction
from fsdp_float8.core.scaling import (
    MAX_SCALE,
    Axiswise,
    DelayedScaling,
    DynamicScaling,
    StaticScaling,
    Tensorwise,
    amax_to_scale,
    axis_amax,
    cast_to_float8_data,
    float8_max,
    round_down_to_power_of_2,
    tensor_amax,
    tensor_amaxes,
)

CAST_BAR = {E4M3: SQNR_DB["cast_e4m3"], E5M2: SQNR_DB["cast_e5m2"]}
DTYPE_IDS = {E4M3: "e4m3", E5M2: "e5m2"}


def _roundtrip(hp: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return hp_to_float8(hp, scale, dtype).dequantize()


@pytest.mark.parametrize("hp_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("granularity", [Tensorwise(), Axiswise()], ids=["tensor", "axis"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=DTYPE_IDS.get)
def test_cast_sqnr(dtype, granularity, hp_dtype) -> None:
    g = torch.Generator().manual_seed(0)
    # rows over 4 decades: axiswise must handle them, tensorwise still meets its bar
    hp = (torch.randn(4, 32, 64, generator=g) * torch.logspace(-2, 2, 32)[:, None]).to(hp_dtype)
    for dim in (-1, 0):
        scale = DynamicScaling(granularity=granularity).scale(hp, dim, dtype)
        assert scale.dtype == torch.float32
        if isinstance(granularity, Axiswise):
            assert scale.shape[dim] == 1 and scale.dim() == hp.dim()
        out = _roundtrip(hp, scale, dtype)
        assert out.dtype == hp_dtype
        assert sqnr_db(hp, out) >= CAST_BAR[dtype], f"dim {dim}"


@pytest.mark.parametrize("hp_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_amax_equals_abs_max_exactly(hp_dtype) -> None:
    """aminmax / amin+amax give max |x| exactly, float32, for every sign pattern; an empty
    tensor gives 0; NaN propagates (a NaN amax must reach the scale, not vanish)."""
    g = torch.Generator().manual_seed(0)
    hp = (torch.randn(6, 40, generator=g) * 3).to(hp_dtype)
    cases = [hp, hp.abs(), -hp.abs(), torch.zeros(3, 5, dtype=hp_dtype), -torch.zeros(4)]
    for t in cases:
        expected = t.float().abs().amax()
        got = tensor_amax(t)
        assert got.dtype == torch.float32 and got.shape == ()
        assert torch.equal(got, expected) and not got.signbit(), (t, got)
        for dim in (0, -1):
            want = t.float().abs().amax(dim=dim, keepdim=True)
            got = axis_amax(t, dim)
            assert got.dtype == torch.float32 and torch.equal(got, want)
            assert not got.signbit().any()
    assert torch.equal(tensor_amax(torch.empty(0, 8, dtype=hp_dtype)), torch.tensor(0.0))
    nan = hp.clone()
    nan[2, 3] = float("nan")
    assert tensor_amax(nan).isnan() and axis_amax(nan, -1)[2].isnan()
    assert not axis_amax(nan, -1)[1].isnan()
    # the CUDA branch of tensor_amaxes is one _foreach_norm(inf): the same numbers
    ts = [hp, hp[:2] * 7, -hp.abs()]
    norms = torch._foreach_norm(ts, float("inf"))
    amaxes = tensor_amaxes(ts + [hp[:0]])
    assert [a.item() for a in amaxes] == [n.float().item() for n in norms] + [0.0]


def test_axiswise_beats_tensorwise_on_uneven_rows() -> None:
    # Seeded, and judged by the worst row: the whole-tensor SQNR is set by the largest rows,
    # which both granularities cast alike (it came out either way depending on the draw).
    g = torch.Generator().manual_seed(5)
    hp = torch.randn(64, 64, generator=g) * torch.logspace(-4, 2, 64)[:, None]
    worst = {}
    for name, granularity in (("tensor", Tensorwise()), ("axis", Axiswise())):
        back = _roundtrip(hp, DynamicScaling(granularity=granularity).scale(hp, -1, E4M3), E4M3)
        worst[name] = min(sqnr_db(h, b) for h, b in zip(hp, back))
    assert worst["axis"] >= SQNR_DB["cast_e4m3"] > worst["tensor"], worst
    # the small rows underflow under one tensorwise scale
    scale = amax_to_scale(hp.abs().amax(), E4M3)
    assert underflow_fraction(hp, scale, E4M3) > 0.05


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=DTYPE_IDS.get)
def test_amax_to_scale_is_fp8_max_over_amax_in_float64(dtype) -> None:
    amax = torch.tensor([3.0, 1e-3, 7.5e4, 1.0 / 3.0])
    want = (float8_max(dtype) / amax.double()).float()
    torch.testing.assert_close(amax_to_scale(amax, dtype), want, rtol=0, atol=0)


@pytest.mark.parametrize("amax_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(), (4096,), (4096, 1), (1, 4096)])
def test_amax_to_scale_equals_the_float64_formula_bit_for_bit(shape, amax_dtype) -> None:
    # every amax rank and dtype the casts hand in (0-d tensorwise, (M, 1) / (1, N) per row
    # or column, a vector of weight amaxes), over 27 binades, against torchao's formula
    g = torch.Generator().manual_seed(3)
    amax = torch.rand(shape, generator=g) * 10.0 ** torch.randint(-24, 4, shape, generator=g)
    amax = amax.to(amax_dtype)
    floor = float8_max(E4M3) / MAX_SCALE
    want = (float8_max(E4M3) / amax.to(torch.float64).clamp(min=floor)).to(torch.float32)
    got = amax_to_scale(amax, E4M3)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("power_of_2", [False, True])
@pytest.mark.parametrize("hp_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=DTYPE_IDS.get)
def test_a_dynamic_scale_needs_no_clamp(dtype, hp_dtype, power_of_2) -> None:
    # with the scale of the tensor's own amax (per tensor, per row, per column) the cast
    # without the clamp writes the same bytes: values over 40 binades, zeros, subnormals,
    # an all-zero row, an amax below the scale floor
    g = torch.Generator().manual_seed(5)
    hp = torch.randn(64, 96, generator=g) * 10.0 ** torch.randint(-20, 20, (64, 96), generator=g)
    hp[3] = 0.0
    hp[5] = torch.finfo(torch.float32).tiny / 8  # subnormal (float32); 0 in bfloat16
    hp[7, :3] = torch.tensor([1e-45, -3e38, 3e38])
    hp = hp.to(hp_dtype)
    for dims in [None, 1, 0]:
        amax = hp.abs().amax() if dims is None else hp.abs().amax(dim=dims, keepdim=True)
        scale = amax_to_scale(amax, dtype, power_of_2=power_of_2)
        # the claim itself: |hp * scale| exceeds fp8_max by float32 rounding at most (the
        # conversion rounds such a value to fp8_max; it would round a few % more so too)
        assert (hp.float() * scale).abs().max() <= float8_max(dtype) * (1 + 2.0**-22)
        for column_major in (False, True):
            kw = dict(column_major=column_major)
            clamped = cast_to_float8_data(hp, scale, dtype, **kw)
            unclamped = cast_to_float8_data(hp, scale, dtype, saturate=False, **kw)
            assert torch.equal(clamped.view(torch.uint8), unclamped.view(torch.uint8)), dims


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=DTYPE_IDS.get)
def test_power_of_2_scales_are_exact_powers_of_two(dtype) -> None:
    g = torch.Generator().manual_seed(1)
    amax = torch.rand(1000, generator=g) * torch.logspace(-6, 6, 1000)
    exact = amax_to_scale(amax, dtype)
    rounded = amax_to_scale(amax, dtype, power_of_2=True)
    mantissa, _ = torch.frexp(rounded)
    assert (mantissa == 0.5).all()  # 2**k exactly
    assert (rounded <= exact).all() and (rounded > exact / 2).all()  # rounded down
    # rounding down keeps amax * scale within the float8 range: no saturation
    assert (amax * rounded <= float8_max(dtype)).all()
    torch.testing.assert_close(round_down_to_power_of_2(torch.tensor(0.75)), torch.tensor(0.5))


def test_rowwise_recipe_scales_are_powers_of_two() -> None:
    config = Float8LinearConfig.from_recipe_name("rowwise")
    assert config.round_scales_to_power_of_2
    hp = torch.randn(16, 64) * 3.7
    for operand, gemm in ((Operand.INPUT, Gemm.OUTPUT), (Operand.GRAD_OUTPUT, Gemm.GRAD_WEIGHT)):
        scale = config.strategy(operand, gemm).scale(hp, -1, E4M3)
        assert scale.shape == (16, 1)
        assert (torch.frexp(scale).mantissa == 0.5).all()
    delayed = DelayedScaling(power_of_2=True)
    state = DelayedState(
        torch.zeros(()), torch.zeros(4), torch.ones(()), torch.zeros((), dtype=torch.bool)
    )
    state.record(torch.tensor(3.3))
    state.roll(state.amax.clone(), delayed, E4M3)
    assert torch.frexp(state.scale).mantissa == 0.5


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("power_of_2", [False, True])
def test_amax_zero_gives_finite_scale_and_zeros(dtype, power_of_2: bool) -> None:
    zeros = torch.zeros(8, 16)
    for granularity in (Tensorwise(), Axiswise()):
        scale = DynamicScaling(granularity=granularity, power_of_2=power_of_2).scale(
            zeros, -1, dtype
        )
        assert torch.isfinite(scale).all() and (scale > 0).all()
        assert scale.max() <= MAX_SCALE
        out = hp_to_float8(zeros, scale, dtype).dequantize()
        assert torch.isfinite(out).all() and (out == 0).all()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_linear_on_zero_input_is_finite(recipe: str) -> None:
    mod = Float8Linear(32, 16, bias=False, config=Float8LinearConfig.from_recipe_name(recipe))
    x = torch.zeros(2, 3, 32, requires_grad=True)
    out = mod(x)
    out.backward(torch.zeros_like(out))
    for t in (out, x.grad, mod.weight.grad):
        assert torch.isfinite(t).all() and (t == 0).all()


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=DTYPE_IDS.get)
def test_cast_saturates_instead_of_overflowing(dtype) -> None:
    hp = torch.tensor([1.0, -2.0, 1e6, -1e6, 0.0])
    scale = torch.tensor(1.0)
    data = cast_to_float8_data(hp, scale, dtype).to(torch.float32)
    fmax = float8_max(dtype)
    assert torch.isfinite(data).all()
    assert data.tolist() == [1.0, -2.0, fmax, -fmax, 0.0]
    assert saturation_fraction(hp, scale, dtype) == pytest.approx(2 / 5)


def test_static_and_delayed_strategies() -> None:
    hp = torch.randn(8, 16) * 100
    static = StaticScaling(scale=0.5).scale(hp, -1, E4M3)
    assert static.dtype == torch.float32 and static.item() == 0.5
    with pytest.raises(ValueError, match="DelayedState"):
        DelayedScaling().scale(hp, -1, E4M3, None)


@pytest.mark.parametrize("emulate", [False, True], ids=["scaled_mm", "emulated"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("b_dtype", [E4M3, E5M2], ids=DTYPE_IDS.get)
def test_gemm_sqnr_and_real_vs_emulated(b_dtype, out_dtype, emulate: bool) -> None:
    g = torch.Generator().manual_seed(2)
    a_hp, b_hp = torch.randn(48, 64, generator=g), torch.randn(32, 64, generator=g)
    want = a_hp @ b_hp.t()
    for granularity in (Tensorwise(), Axiswise()):
        strategy = DynamicScaling(granularity=granularity)
        a = hp_to_float8(a_hp, strategy.scale(a_hp, -1, E4M3), E4M3, emulate=emulate)
        b = hp_to_float8(b_hp, strategy.scale(b_hp, -1, b_dtype), b_dtype, emulate=emulate).t()
        out = scaled_mm(a, b, out_dtype=out_dtype, emulate=emulate)
        assert out.dtype == out_dtype and out.shape == (48, 32)
        bar = SQNR_DB["gemm_e4m3"] if b_dtype == E4M3 else SQNR_DB["cast_e5m2"]
        assert sqnr_db(want, out) >= bar
        other = scaled_mm(a, b, out_dtype=out_dtype, emulate=not emulate)
        assert sqnr_db(other, out) >= SQNR_DB["real_vs_emulated"]


@pytest.mark.parametrize("emulate", [False, True], ids=["scaled_mm", "emulated"])
def test_gemm_pads_inner_dim(emulate: bool) -> None:
    a_hp, b_hp = torch.randn(16, 40), torch.randn(24, 40)  # K = 40, not a multiple of 16
    scale = torch.tensor(20.0)
    a = hp_to_float8(a_hp, scale, E4M3, emulate=emulate)
    b = hp_to_float8(b_hp, scale, E4M3, emulate=emulate).t()
    out = scaled_mm(a, b, out_dtype=torch.float32, emulate=emulate, pad_inner_dim=True)
    assert sqnr_db(a_hp @ b_hp.t(), out) >= SQNR_DB["gemm_e4m3"]
    unpadded = (a.dequantize()) @ (b.dequantize())
    torch.testing.assert_close(out, unpadded)  # zero padding adds nothing


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("power_of_2", [True, False], ids=["pow2", "any"])
def test_row_scales_around_a_unit_gemm_equal_the_dequantized_product(power_of_2, out_dtype):
    # Where CPU torch._scaled_mm takes only 0-d scales (torch 2.11), row scales are applied
    # around a GEMM with unit scales. Its definition is the dequantized product
    # (a * inv_a) @ (b * inv_b): with power-of-two scales every scaling is exact, so the
    # results are equal; otherwise each of the two float32 dot products of length K is
    # within gamma_K ~ K * eps/2 of exact (plus two roundings of the scalings), so they
    # differ by at most (K + 2) * eps * (|a_deq| @ |b_deq|) per element.
    g = torch.Generator().manual_seed(4)
    rows = torch.logspace(-2, 2, 48).unsqueeze(1)
    a_hp, b_hp = torch.randn(48, 64, generator=g) * rows, torch.randn(32, 64, generator=g)
    scale_a = amax_to_scale(axis_amax(a_hp, -1), E4M3, power_of_2=power_of_2)
    scale_b = amax_to_scale(axis_amax(b_hp, -1), E4M3, power_of_2=power_of_2)
    a_data = cast_to_float8_data(a_hp, scale_a, E4M3)
    b_data = cast_to_float8_data(b_hp, scale_b, E4M3).t()
    inv_a, inv_b = scale_a.reciprocal(), scale_b.reciprocal().t()
    got = row_scaled_mm_around_unit_gemm(a_data, b_data, inv_a, inv_b, torch.float32)
    a_deq, b_deq = a_data.float() * inv_a, b_data.float() * inv_b
    paths = {"dequantized": a_deq @ b_deq}
    if cpu_scaled_mm_takes_row_scales():  # torch 2.13+: the native row-scale path too
        paths["native"] = torch._scaled_mm(a_data, b_data, inv_a, inv_b, out_dtype=torch.float32)
    eps = torch.finfo(torch.float32).eps
    bound = 0 if power_of_2 else (64 + 2) * eps * (a_deq.abs() @ b_deq.abs())
    for name, want in paths.items():
        assert ((got - want).abs() <= bound).all(), name
    # out_dtype is one rounding of the float32 result
    low = row_scaled_mm_around_unit_gemm(a_data, b_data, inv_a, inv_b, out_dtype)
    assert low.dtype == out_dtype and torch.equal(low, got.to(out_dtype))
