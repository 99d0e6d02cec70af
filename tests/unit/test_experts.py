"""Float8 grouped expert GEMMs (fsdp_float8.experts.gemm / grouped_mm): the three GEMMs of an
expert projection against a float64 reference (SQNR bars of fsdp_float8.core.numerics), the
emulated grouped GEMM against its own definition, and the grouped GEMM against a loop of the
existing float8 linear GEMMs, one expert at a time (bit-exact: the same casts, the same
per-expert GEMM), with empty experts and skewed routing."""

from __future__ import annotations

import re

import pytest
import torch

from fsdp_float8 import CastConfig, Float8LinearConfig, sqnr_db
from fsdp_float8.core.config import E4M3
from fsdp_float8.core.numerics import SQNR_DB
from fsdp_float8.core.scaling import amax_to_scale, axis_amax, cast_to_float8_data
from fsdp_float8.experts.gemm import ExpertCastPlan, float8_grouped_mm
from fsdp_float8.experts.grouped_mm import dequantize_operands, grouped_scaled_mm
from fsdp_float8.nn.linear import CastPlan, _Float8LinearFn

E, K, N = 4, 64, 48
ROUTINGS = {
    "empty_expert": [7, 0, 40, 17],  # expert 1 gets no token
    "skewed": [2, 58, 1, 3],  # one expert takes ~90% of the tokens
    "one_token": [1, 1, 0, 1],
}


def _offs(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def _data(counts, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = sum(counts)
    x = torch.randn(m, K, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(E, N, K, generator=g) / K**0.5).to(dtype).requires_grad_()
    go = torch.randn(m, N, generator=g).to(dtype)
    return x, w, go


def _grouped(x, w, go, counts, config):
    out = float8_grouped_mm(x, w, _offs(counts), ExpertCastPlan.from_config(config))
    out.backward(go)
    return out.detach(), x.grad, w.grad


def _per_expert_linears(x, w, go, counts, config):
    """The existing float8 linear GEMMs (Float8Linear's autograd function), one expert at a
    time on that expert's tokens."""
    plan, outs, gxs, gws, start = CastPlan.from_config(config), [], [], [], 0
    for e, c in enumerate(counts):
        xe = x.detach()[start : start + c].clone().requires_grad_()
        we = w.detach()[e].clone().requires_grad_()
        _Float8LinearFn.apply(xe, we, plan, {}, False).backward(go[start : start + c])
        outs.append(_Float8LinearFn.apply(xe.detach(), we.detach(), plan, {}, False))
        gxs.append(xe.grad)
        gws.append(we.grad)
        start += c
    return torch.cat(outs), torch.cat(gxs), torch.stack(gws)


def _float64_reference(x, w, go, counts):
    x64, w64, go64 = x.detach().double(), w.detach().double(), go.double()
    outs, gxs, gws, start = [], [], [], 0
    for e, c in enumerate(counts):
        xs, gs = x64[start : start + c], go64[start : start + c]
        outs.append(xs @ w64[e].T)
        gxs.append(gs @ w64[e])
        gws.append(gs.T @ xs)
        start += c
    return torch.cat(outs), torch.cat(gxs), torch.stack(gws)


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize(
    "recipe,emulate",
    [("rowwise", True), ("rowwise", False), ("rowwise_with_gw_hp", True)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_equals_per_expert_float8_linears(recipe, emulate, dtype, routing):
    counts = ROUTINGS[routing]
    config = Float8LinearConfig.from_recipe_name(recipe, emulate=emulate)
    x, w, go = _data(counts, dtype)
    got = _grouped(x, w, go, counts, config)
    want = _per_expert_linears(x, w, go, counts, config)
    for name, g, r in zip(("output", "grad_input", "grad_weight"), got, want):
        assert torch.equal(g, r), f"{name}: max diff {(g - r).abs().max()}"


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize(
    "recipe,overrides",
    [
        ("rowwise", {}),
        ("rowwise", {"round_scales_to_power_of_2": False}),
        ("tensorwise", {}),
        ("tensorwise", {"round_scales_to_power_of_2": True}),
        ("rowwise_with_gw_hp", {}),
    ],
)
@pytest.mark.parametrize("emulate", [True, False])
def test_grouped_sqnr_against_float64(recipe, overrides, emulate, routing):
    counts = ROUTINGS[routing]
    config = Float8LinearConfig.from_recipe_name(recipe, emulate=emulate, **overrides)
    x, w, go = _data(counts, torch.bfloat16, seed=1)
    got = _grouped(x, w, go, counts, config)
    ref = _float64_reference(x, w, go, counts)
    bars = {"output": "linear_output", "grad_input": "linear_grad_input"}
    bars["grad_weight"] = "linear_grad_weight"
    for (name, bar), g, r in zip(bars.items(), got, ref):
        assert sqnr_db(r, g) >= SQNR_DB[bar], f"{name}: {sqnr_db(r, g):.1f} dB"
    empty = [e for e, c in enumerate(counts) if c == 0]
    assert all(got[2][e].abs().max() == 0 for e in empty)  # no tokens, no gradient


def _rowwise_operands(counts, seed=2):
    """Float8 operands of the output GEMM: tokens per row, the weight per output row."""
    x, w, _ = _data(counts, torch.float32, seed)
    x, w = x.detach(), w.detach()
    xs = amax_to_scale(axis_amax(x, -1), E4M3)
    ws = amax_to_scale(axis_amax(w, -1), E4M3)
    wt, wts = cast_to_float8_data(w, ws, E4M3).transpose(-2, -1), ws.transpose(-2, -1)
    return cast_to_float8_data(x, xs, E4M3), xs, wt, wts


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_emulated_grouped_gemm_is_its_definition(routing, monkeypatch):
    """emulate=True: dequantize to float32, torch._grouped_mm, round once; the per-group
    float32 loop (used where torch has no CPU _grouped_mm) gives the same bits here."""
    counts = ROUTINGS[routing]
    offs = _offs(counts)
    a, a_s, b, b_s = _rowwise_operands(counts)
    got = grouped_scaled_mm(a, a_s, b, b_s, offs, out_dtype=torch.bfloat16, emulate=True)
    a_hp, b_hp = dequantize_operands(a, a_s, b, b_s, offs)
    want = torch._grouped_mm(a_hp, b_hp, offs=offs).to(torch.bfloat16)
    assert torch.equal(got, want)
    monkeypatch.setattr("fsdp_float8.experts.grouped_mm.grouped_mm_available", lambda device: False)
    looped = grouped_scaled_mm(a, a_s, b, b_s, offs, out_dtype=torch.bfloat16, emulate=True)
    assert torch.equal(looped, want)


def test_emulated_and_cpu_kernel_agree():
    """The CPU float8 kernel loop and the emulation dequantize the same operands; they agree
    to float32 rounding (real_vs_emulated bar)."""
    counts = ROUTINGS["skewed"]
    offs = _offs(counts)
    a, a_s, b, b_s = _rowwise_operands(counts)
    emu = grouped_scaled_mm(a, a_s, b, b_s, offs, out_dtype=torch.float32, emulate=True)
    real = grouped_scaled_mm(a, a_s, b, b_s, offs, out_dtype=torch.float32, emulate=False)
    assert sqnr_db(emu, real) >= SQNR_DB["real_vs_emulated"]


@pytest.mark.parametrize("three_d", [True, False], ids=["2d_x_3d", "2d_x_2d"])
@pytest.mark.parametrize("emulate", [True, False], ids=["emulated", "cpu_kernel"])
def test_refuses_scales_not_along_the_contraction_dim(three_d, emulate):
    """A scale along the wrong dim (one per column of a, per row of b) would broadcast into a
    wrong product in the emulation: refused by name, as scaled_mm refuses it."""
    offs = _offs(ROUTINGS["skewed"])
    m = int(offs[-1])
    a = torch.randn(m, K).to(E4M3) if three_d else torch.randn(N, m).to(E4M3)
    b = torch.randn(E, K, N).to(E4M3) if three_d else torch.randn(m, K).to(E4M3)
    bad_a = torch.rand(1, a.shape[1]) + 1  # per column of a: along the kept dim
    good_b = torch.rand(E, 1, N) + 1 if three_d else torch.rand(E, K) + 1
    with pytest.raises(ValueError, match=r"grouped_scaled_mm needs a's scale 0-d or of shape"):
        grouped_scaled_mm(a, bad_a, b, good_b, offs, out_dtype=torch.float32, emulate=emulate)
    good_a = torch.rand(m, 1) + 1 if three_d else torch.rand(E, N) + 1
    bad_b = torch.rand(E, K, 1) + 1 if three_d else torch.rand(m, 1) + 1  # per row of b
    with pytest.raises(ValueError, match=re.escape(f"{tuple(bad_b.shape)}: each operand")):
        grouped_scaled_mm(a, good_a, b, bad_b, offs, out_dtype=torch.float32, emulate=emulate)
    out = grouped_scaled_mm(a, good_a, b, good_b, offs, out_dtype=torch.float32, emulate=emulate)
    assert out.shape == ((m, N) if three_d else (E, N, K))


def test_refuses_delayed_and_static_expert_casts():
    config = Float8LinearConfig.from_recipe_name(
        "tensorwise", cast_config_weight=CastConfig(scaling_type="delayed")
    )
    with pytest.raises(ValueError, match="scale dynamically only; weight for output is delayed"):
        ExpertCastPlan.from_config(config)


@pytest.mark.parametrize(
    "offs,match",
    [
        (torch.tensor([3, 6, 6, 8]), "1-D int32"),
        (torch.tensor([3, 6, 8], dtype=torch.int32), "4 cumulative token counts"),
        (torch.tensor([3, 6, 6, 7], dtype=torch.int32), "offs ends at 7 but there are 8"),
    ],
)
def test_refuses_bad_offsets(offs, match):
    plan = ExpertCastPlan.from_config(Float8LinearConfig.from_recipe_name("rowwise"))
    with pytest.raises(ValueError, match=match):
        float8_grouped_mm(torch.randn(8, K), torch.randn(E, N, K), offs, plan)


def test_cuda_grouped_gemm_is_not_claimed_on_cpu():
    from fsdp_float8.core._compat import grouped_mm_available, scaled_grouped_mm_available

    assert not scaled_grouped_mm_available(torch.device("cpu"))
    assert grouped_mm_available("cpu") == hasattr(torch, "_grouped_mm")


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_refuses_block_scaled_expert_casts(recipe):
    """Block scales (1x128, MX 1x32) are not implemented for experts: refused, not misread."""
    config = Float8LinearConfig.from_recipe_name(recipe)
    with pytest.raises(ValueError, match="block-scaled float8 expert GEMMs are not supported"):
        ExpertCastPlan.from_config(config)


@pytest.mark.parametrize("three_d", [True, False], ids=["2d_x_3d", "2d_x_2d"])
def test_cuda_grouped_gemm_gets_row_scales_for_a_tensorwise_operand(monkeypatch, three_d):
    """torch._scaled_grouped_mm takes row scales only: a 0-d scale (rowwise_with_gw_hp's
    tensorwise grad_input weight) goes in repeated per row, float32, in the kernel's shapes."""
    from fsdp_float8.experts import grouped_mm

    seen = {}

    def kernel(a, b, inv_a, inv_b, *, offs, out_dtype, use_fast_accum):
        seen.update(inv_a=inv_a, inv_b=inv_b)
        return torch.empty(0)

    monkeypatch.setattr(grouped_mm, "scaled_grouped_mm_available", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", kernel, raising=False)
    offs = _offs([7, 0, 40, 17])
    m = int(offs[-1])
    a = torch.randn(m, K).to(E4M3) if three_d else torch.randn(N, m).to(E4M3)
    b = torch.randn(E, K, N).to(E4M3) if three_d else torch.randn(m, K).to(E4M3)
    a_scale = torch.rand(m, 1) + 1 if three_d else torch.rand(E, N) + 1
    b_scale = torch.tensor(4.0)
    grouped_mm._cuda_scaled_grouped_mm(a, a_scale, b, b_scale, offs, torch.bfloat16, False)
    rows_b = (E, N) if three_d else (E * K,)
    assert seen["inv_a"].shape == (a_scale.numel(),)
    assert seen["inv_b"].shape == rows_b and seen["inv_b"].is_contiguous()
    assert seen["inv_b"].dtype == torch.float32 and bool((seen["inv_b"] == 0.25).all())
    with pytest.raises(ValueError, match="e4m3 operands"):  # e5m2 (tensorwise grad_output)
        grouped_mm._cuda_scaled_grouped_mm(
            a.to(torch.float8_e5m2), a_scale, b, b_scale, offs, torch.bfloat16, False
        )


def test_align_token_groups_starts_every_group_at_16_tokens():
    """The CUDA 2-D x 2-D layout (grad_weight): each group's tokens moved to a 16-aligned
    start, byte for byte, zeros in the gaps, so the per-group products are unchanged."""
    from fsdp_float8.experts.grouped_mm import align_token_groups

    counts = [7, 0, 40, 17]
    offs, m = _offs(counts), sum(counts)
    a = torch.randn(N, m).to(E4M3)
    b = torch.randn(m, K).to(E4M3).t().contiguous().t()  # column-major, as the kernel has it
    a2, b2, offs2 = align_token_groups(a, b, offs)
    assert offs2.tolist() == [16, 16, 64, 96] and b2.t().is_contiguous()
    assert a2.shape[1] % 16 == 0 and a2.shape[1] >= 96
    starts, new_starts = [0, *offs.tolist()[:-1]], [0, *offs2.tolist()[:-1]]
    raw = lambda t: t.view(torch.uint8)  # noqa: E731
    for count, s, s2 in zip(counts, starts, new_starts):
        assert torch.equal(raw(a2[:, s2 : s2 + count]), raw(a[:, s : s + count]))
        assert torch.equal(raw(b2[s2 : s2 + count]), raw(b[s : s + count]))
    assert int(raw(a2).count_nonzero()) == int(raw(a).count_nonzero())  # gaps: zeros
    assert int(raw(b2).count_nonzero()) == int(raw(b).count_nonzero())
