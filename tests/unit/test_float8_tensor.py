"""Float8Tensor: the ops a linear and FSDP2 need, scales moving with shape ops, refusals of
everything else, gradients through the cast, and torch.save / weights_only loading."""

from __future__ import annotations

import io

import pytest
import torch

import fsdp_float8  # noqa: F401  (registers the safe globals for weights_only loading)
from fsdp_float8 import Float8Tensor, hp_to_float8, scaled_mm, sqnr_db
from fsdp_float8.core.config import E4M3, E5M2
from fsdp_float8.core.numerics import SQNR_DB
from fsdp_float8.core.scaling import amax_to_scale


def _tensorwise(hp: torch.Tensor, dtype: torch.dtype = E4M3, **kw) -> Float8Tensor:
    return hp_to_float8(hp, amax_to_scale(hp.detach().abs().amax(), dtype), dtype, **kw)


def _axiswise(hp: torch.Tensor, dim: int = -1, dtype: torch.dtype = E4M3) -> Float8Tensor:
    scale = amax_to_scale(hp.detach().abs().amax(dim=dim, keepdim=True), dtype)
    return hp_to_float8(hp, scale, dtype)


def _hp(*shape: int, seed: int = 0) -> torch.Tensor:
    # rows of very different magnitude, so a scale applied to the wrong row shows
    g = torch.Generator().manual_seed(seed)
    rows = torch.logspace(-3, 3, shape[0]).reshape(-1, *([1] * (len(shape) - 1)))
    return torch.randn(*shape, generator=g) * rows


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0)


MAKERS = {"tensorwise": _tensorwise, "axiswise_rows": _axiswise}


def test_constructor_reports_orig_dtype_and_checks_inputs() -> None:
    hp = _hp(8, 16).to(torch.bfloat16)
    t = _tensorwise(hp)
    assert isinstance(t, Float8Tensor) and t.dtype == torch.bfloat16 and t.shape == hp.shape
    assert t.float8_dtype == E4M3 and t._data.dtype == E4M3
    assert t.dequantize().dtype == torch.bfloat16
    with pytest.raises(TypeError, match="float32"):
        hp_to_float8(hp, torch.tensor(1.0, dtype=torch.float64), E4M3)
    with pytest.raises(TypeError, match="Float8Tensor"):
        hp_to_float8(t, torch.tensor(1.0), E4M3)


@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
def test_transpose_moves_the_scale(make) -> None:
    t = make(_hp(16, 32))
    for moved in (t.t(), t.transpose(0, 1), torch.transpose(t, 1, 0)):
        assert isinstance(moved, Float8Tensor) and moved.shape == (32, 16)
        _same(moved.dequantize(), t.dequantize().t())
    if t._scale.dim():
        assert t.t()._scale.shape == (1, 16)


def test_view_and_reshape_move_axiswise_scales() -> None:
    hp = _hp(4 * 8, 48)
    t = _axiswise(hp)
    for shaped in (t.view(4, 8, 48), t.reshape(4, 8, 48), t.view(4, -1, 48)):
        assert shaped._scale.shape == (4, 8, 1)
        _same(shaped.dequantize(), t.dequantize().view(4, 8, 48))
        back = shaped.view(32, 48)
        assert back._scale.shape == (32, 1)
        _same(back.dequantize(), t.dequantize())
    cols = _axiswise(hp, dim=0)  # scale (1, 48): per column
    _same(cols.view(4, 8, 48).dequantize(), cols.dequantize().view(4, 8, 48))
    with pytest.raises(ValueError, match="only views that keep the last dim"):
        t.view(32 * 48)
    tw = _tensorwise(hp)
    _same(tw.view(-1).dequantize(), tw.dequantize().view(-1))


@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
def test_clone_detach_alias(make) -> None:
    t = make(_hp(16, 32))
    c = t.clone()
    _same(c.dequantize(), t.dequantize())
    assert c._data.data_ptr() != t._data.data_ptr()
    assert c._scale.data_ptr() != t._scale.data_ptr()
    c._data.zero_()
    assert t.dequantize().abs().sum() > 0  # the clone owns its data
    d = t.detach()
    assert isinstance(d, Float8Tensor) and d._data.data_ptr() == t._data.data_ptr()


def test_to_copy_changes_orig_dtype_not_data() -> None:
    t = _tensorwise(_hp(16, 32))
    b = t.to(torch.bfloat16)
    assert isinstance(b, Float8Tensor) and b.dtype == torch.bfloat16 and b._data.dtype == E4M3
    _same(b._data.view(torch.uint8), t._data.view(torch.uint8))
    assert b._scale.dtype == torch.float32
    with pytest.raises(TypeError, match="already is float8"):
        t.to(E5M2)


def test_split_chunk_cat_tensorwise_share_the_scale() -> None:
    t = _tensorwise(_hp(32, 16))
    pieces = torch.chunk(t, 4)
    assert all(p._scale is t._scale for p in pieces)
    for i, p in enumerate(t.split([8, 24])):
        start = (0, 8)[i]
        _same(p.dequantize(), t.dequantize()[start : start + p.shape[0]])
    whole = torch.cat(pieces)
    assert isinstance(whole, Float8Tensor) and whole._scale is t._scale
    _same(whole.dequantize(), t.dequantize())
    other = _tensorwise(_hp(8, 16, seed=1))
    with pytest.raises(ValueError, match="different scale"):
        torch.cat([pieces[0], other])
    with pytest.raises(TypeError, match="plain tensors"):
        torch.cat([pieces[0], torch.zeros(8, 16)])


def test_split_and_cat_axiswise_slice_the_scale() -> None:
    t = _axiswise(_hp(32, 16))
    pieces = torch.chunk(t, 4, dim=0)
    assert [p._scale.shape for p in pieces] == [(8, 1)] * 4
    for i, p in enumerate(pieces):
        _same(p.dequantize(), t.dequantize()[8 * i : 8 * (i + 1)])
    whole = torch.cat(pieces)
    assert whole._scale.shape == (32, 1)
    _same(whole.dequantize(), t.dequantize())
    cols = torch.chunk(t, 2, dim=1)  # along the reduced dim: the scale is kept whole
    assert [c._scale.shape for c in cols] == [(32, 1)] * 2
    _same(torch.cat(cols, dim=1).dequantize(), t.dequantize())
    with pytest.raises(ValueError, match="different scale"):
        torch.cat([cols[0], _axiswise(_hp(32, 8, seed=1))], dim=1)


@pytest.mark.parametrize("dim", [0, 1])
def test_slice_moves_axiswise_scale(dim: int) -> None:
    t = _axiswise(_hp(32, 48), dim=1 - dim)  # scale varies along `dim`
    sliced = t[2:10] if dim == 0 else t[:, 4:20:2]
    want = t.dequantize()[2:10] if dim == 0 else t.dequantize()[:, 4:20:2]
    _same(sliced.dequantize(), want)
    assert sliced._scale.shape[dim] == sliced.shape[dim]
    tw = _tensorwise(_hp(32, 48))
    assert tw[2:10]._scale is tw._scale
    _same(tw[:, 4:8].dequantize(), tw.dequantize()[:, 4:8])


@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
def test_as_strided_cuts_rows(make) -> None:
    # FSDP2 as_strided's the padded all-gather output down to the parameter's size
    t = make(_hp(20, 16))
    cut = torch.as_strided(t, (12, 16), (16, 1))
    _same(cut.dequantize(), t.dequantize()[:12])
    with pytest.raises(ValueError, match="per-row scales"):
        torch.as_strided(_axiswise(_hp(20, 16), dim=0), (12, 16), (16, 1))


@pytest.mark.parametrize("emulate", [False, True], ids=["scaled_mm", "emulated"])
@pytest.mark.parametrize("granularity", ["tensorwise", "axiswise"])
def test_mm_and_addmm_go_through_scaled_mm(granularity: str, emulate: bool) -> None:
    a_hp, b_hp = torch.randn(32, 64), torch.randn(48, 64)
    if granularity == "tensorwise":
        a, b = _tensorwise(a_hp, emulate=emulate), _tensorwise(b_hp, emulate=emulate).t()
    else:
        a, b = _axiswise(a_hp), _axiswise(b_hp).t()  # both scaled along K
        a._emulate = b._emulate = emulate
    out = torch.mm(
        a, b
    )  # its SQNR: tests/unit/test_scaling.py::test_gemm_sqnr_and_real_vs_emulated
    assert type(out) is torch.Tensor and out.dtype == torch.float32
    _same(out, scaled_mm(a, b, out_dtype=torch.float32, emulate=emulate))
    bias = torch.randn(48)
    _same(torch.addmm(bias, a, b), out + bias)
    with pytest.raises(TypeError, match="both operands as Float8Tensor"):
        torch.mm(a, b_hp.t())


def test_scaled_mm_refuses_scales_along_the_wrong_dim() -> None:
    a = _axiswise(torch.randn(32, 64), dim=0)  # per column: wrong for the left operand
    b = _axiswise(torch.randn(48, 64)).t()
    with pytest.raises(ValueError, match="contraction dim"):
        scaled_mm(a, b, out_dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_and_gradient_through_the_cast(dtype: torch.dtype) -> None:
    hp = torch.randn(16, 32, dtype=dtype, requires_grad=True)
    t = _tensorwise(hp)
    assert t.requires_grad
    assert sqnr_db(hp, t.dequantize()) >= SQNR_DB["cast_e4m3"]
    assert not t.dequantize().requires_grad  # dequantize is the non-differentiable form
    back = t.to_original_precision()
    assert back.dtype == dtype and back.requires_grad
    weights = torch.randn(16, 32, dtype=dtype)
    (back * weights).sum().backward()
    _same(hp.grad, weights)  # straight-through: the cast is treated as identity


@pytest.mark.parametrize(
    "op, name",
    [
        (lambda t: t + t, "aten.add"),
        (lambda t: t * 2, "aten.mul"),
        (lambda t: t.sum(), "aten.sum"),
        (lambda t: torch.exp(t), "aten.exp"),
        (lambda t: torch.relu(t), "aten.relu"),
    ],
    ids=["add", "mul", "sum", "exp", "relu"],
)
def test_unsupported_ops_raise_naming_the_op(op, name: str) -> None:
    with pytest.raises(NotImplementedError, match=name) as info:
        op(_tensorwise(_hp(8, 16)))
    assert "to_original_precision" in str(info.value)


def test_copy_rules() -> None:
    src, dst = _tensorwise(_hp(8, 16)), _tensorwise(_hp(8, 16, seed=3))
    dst.copy_(src)
    _same(dst.dequantize(), src.dequantize())
    plain = torch.empty(8, 16)
    plain.copy_(src)
    _same(plain, src.dequantize())
    with pytest.raises(TypeError, match="hp_to_float8"):
        dst.copy_(torch.zeros(8, 16))


@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
def test_save_and_weights_only_load(make) -> None:
    t = make(_hp(16, 32).to(torch.bfloat16))
    t._emulate = True
    buffer = io.BytesIO()
    torch.save({"t": t, "nested": [t.t()]}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    got = loaded["t"]
    assert isinstance(got, Float8Tensor) and got.dtype == torch.bfloat16 and got._emulate
    _same(got._data.view(torch.uint8), t._data.view(torch.uint8))
    _same(got._scale, t._scale)
    _same(loaded["nested"][0].dequantize(), t.t().dequantize())
