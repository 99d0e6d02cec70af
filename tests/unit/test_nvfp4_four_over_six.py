"""NVFP4 with four-over-six block scales (`nvfp4.quantize(..., four_over_six=True)`,
`NVFP4Config(four_over_six=True)`): each block's kept encoding never has a larger error
than the 6-only encoding with the same tensor factor, the codes and factors bit for bit
against a per-block reference written here (and decoded by hand on crafted blocks), the
256 bound of the tensor factor, transpose invariance of 16x16 tiles, whole-tile shards
quantizing as the whole, stochastic rounding (the choice independent of the draws, the
cast unbiased), the cast and layer SQNR, each GEMM of the layer against its definition,
a compiled quantize equal to eager, and the refusals.

SQNR floors: measured on CPU (torch 2.13) over seeds 0..31 at the shapes of
tests/unit/test_nvfp4.py (casts 128x512) and tests/unit/test_nvfp4_linear.py (x (4, 64,
256) randn, nn.Linear(256, 128)'s init, grad_output randn, Hadamard transform and
stochastic rounding on); each floor is mean - 6 * std rounded down to 0.1 dB, the measured
mean / std in the comment, as the NVFP4 floors there are derived.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_float8 import Float8ConfigError, NVFP4Config, NVFP4Linear
from fsdp_float8.core import e2m1, nvfp4, nvfp4_gemm
from fsdp_float8.core.blocks import expand_block_scale
from fsdp_float8.core.numerics import sqnr_db
from fsdp_float8.core.scaling import block_amax
from tests.unit.test_nvfp4 import _blocks, _heavy, _ref_codes
from tests.unit.test_nvfp4_linear import _grads
from tests.unit.test_nvfp4_linear import _layer as nvfp4_layer

E4M3 = torch.float8_e4m3fn

CAST_SQNR_FLOOR_DB = {
    ("randn", (1, 16)): 21.0,  # 21.21 / 0.022
    ("randn", (16, 16)): 18.8,  # 19.07 / 0.034
    ("heavy", (1, 16)): 20.9,  # 21.43 / 0.078
    ("heavy", (16, 16)): 13.8,  # 14.49 / 0.105
}
SR_SQNR_FLOOR_DB = 16.7  # randn, 1x16: 16.99 / 0.036
# four-over-six minus NVFP4, paired per seed, randn 1x16: 0.78 / 0.019
GAIN_FLOOR_DB = 0.6
LAYER_SQNR_FLOOR_DB = {
    "output": 17.7,  # 18.09 / 0.051
    "grad_input": 14.9,  # 15.21 / 0.051 (stochastic rounding of grad_output)
    "grad_weight": 15.2,  # 15.61 / 0.062
}


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _amax(x: torch.Tensor) -> torch.Tensor:
    return x.abs().max()


def _q(x, amax=None, block=nvfp4.ACTIVATION_BLOCK, **kw) -> nvfp4.NVFP4:
    return nvfp4.quantize(x, _amax(x) if amax is None else amax, block, four_over_six=True, **kw)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ------------------------------------------------------------------------ the per-block choice


def _candidate(x, tensor_inv, block, target, *, round_up=False):
    """The encoding with every block's amax scaled to `target`, from the primitives."""
    factors = nvfp4.block_inv_scales(
        block_amax(x, block), tensor_inv, round_up=round_up, target=target
    )
    per = expand_block_scale(factors.float() * tensor_inv, block, x.shape)
    return nvfp4.NVFP4(e2m1.pack_e2m1(e2m1.e2m1_codes(x / per)), factors, tensor_inv, block)


def _block_sse64(x, q) -> torch.Tensor:
    """Each block's sum of squared dequantization errors, float64, one block at a time."""
    deq = nvfp4.dequantize(q)
    out = torch.zeros(q.block_inv_scale.shape, dtype=torch.float64)
    for bi, bj, r, c in _blocks(x.shape, q.block):
        out[bi, bj] = (deq[r, c].double() - x[r, c].double()).pow(2).sum()
    return out


def _inputs():
    g = _gen(3)
    ragged = torch.randn(40, 56, generator=g) * torch.rand(40, 1, generator=g) * 3
    ragged[16:32] *= 1e-5  # factors in e4m3's subnormals
    yield "randn", torch.randn(64, 128, generator=g)
    yield "heavy", _heavy((64, 128), g)
    yield "ragged", ragged


@pytest.mark.parametrize("block", nvfp4.BLOCKS)
def test_each_block_error_is_at_most_the_six_only_encodings(block) -> None:
    """Against the 6-only encoding with the same tensor factor (amax / (6 * 256)): no
    block dequantizes worse (float64 sums; a block within float32 rounding of a tie may
    go either way), both candidates are chosen somewhere, and every block's codes and
    factor are those of the candidate chosen."""
    for name, x in _inputs():
        amax = _amax(x)
        q = _q(x, amax, block)
        tensor_inv = nvfp4.tensor_inv_scale(amax, nvfp4.FOUR_OVER_SIX_BLOCK_BOUND)
        six = _candidate(x, tensor_inv, block, 6.0)
        four = _candidate(x, tensor_inv, block, 4.0)
        err, err6, err4 = _block_sse64(x, q), _block_sse64(x, six), _block_sse64(x, four)
        assert (err <= err6 * (1 + 1e-6)).all(), (name, (err - err6).max())
        assert (
            torch.equal(err, torch.minimum(err6, err4))
            or ((err - torch.minimum(err6, err4)).abs() <= 1e-6 * err6).all()
        ), name
        chose4 = _bytes(q.block_inv_scale) == _bytes(four.block_inv_scale)
        chose6 = _bytes(q.block_inv_scale) == _bytes(six.block_inv_scale)
        assert (chose4 | chose6).all(), name
        # both occur where the candidates differ (randn: 1x16 blocks about half each)
        differ = _bytes(six.block_inv_scale) != _bytes(four.block_inv_scale)
        if name == "randn":
            assert (chose4 & differ).any() and (chose6 & differ).any(), name
        codes, codes4, codes6 = (e2m1.unpack_e2m1(t.packed) for t in (q, four, six))
        use4 = expand_block_scale(chose4 & differ, block, x.shape)
        assert torch.equal(codes, torch.where(use4, codes4, codes6)), name
        assert torch.equal(q.tensor_inv_scale, tensor_inv)


def _reference_four_over_six(x, amax: float, block):
    """The documented recipe one block at a time: factors block_amax / (6 t) and
    block_amax / (4 t) made e4m3, codes by the brute-force nearest search of
    test_nvfp4, the float64 sum of squared errors; 4 kept where strictly smaller."""
    t = float(torch.tensor(amax / (6 * 256), dtype=torch.float64).float())
    codes = torch.zeros(x.shape, dtype=torch.uint8)
    factors = torch.zeros(-(-x.shape[0] // block[0]), -(-x.shape[1] // block[1]), dtype=E4M3)
    near_tie = torch.zeros(factors.shape, dtype=torch.bool)
    for bi, bj, r, c in _blocks(x.shape, block):
        tile, best = x[r, c], None
        for target in (6.0, 4.0):
            s = float(torch.tensor(float(tile.abs().max()) / (target * t)).float())
            factor = float(torch.tensor(min(max(s, 2.0**-9), 448.0)).to(E4M3).float())
            divisor = torch.tensor(factor * t, dtype=torch.float32)
            c_ = _ref_codes(tile / divisor).reshape(tile.shape)
            deq = (e2m1.e2m1_values(c_).double() * factor * t).float()
            sse = float((deq.double() - tile.double()).pow(2).sum())
            if best is None or sse < best[0]:
                if best is not None and abs(sse - best[0]) <= 1e-6 * best[0]:
                    near_tie[bi, bj] = True
                best = (sse, factor, c_)
        factors[bi, bj] = best[1]
        codes[r, c] = best[2]
    return codes, factors, torch.tensor(t), near_tie


@pytest.mark.parametrize("block", nvfp4.BLOCKS)
def test_quantize_equals_the_per_block_reference(block) -> None:
    x = next(x for name, x in _inputs() if name == "ragged")
    for amax in (float(_amax(x)), 1.5 * float(_amax(x))):  # a shard's larger global amax
        q = _q(x, torch.tensor(amax), block)
        codes, factors, t, near_tie = _reference_four_over_six(x, amax, block)
        keep = ~expand_block_scale(near_tie, block, x.shape)
        assert torch.equal(e2m1.unpack_e2m1(q.packed)[keep], codes[keep])
        assert torch.equal(_bytes(q.block_inv_scale)[~near_tie], _bytes(factors)[~near_tie])
        assert torch.equal(q.tensor_inv_scale, t.float())


def test_crafted_blocks_decode_by_hand() -> None:
    """amax 12: tensor factor 12 / 1536 = 1/128 (exact).
    row 0, [4.5] * 15 + [6] (block amax 6): scaled to 6 (factor 128, step 1) 4.5 -> 4, off
    by 1/2 each; scaled to 4 (factor 192, step 1.5) exact: 4 is kept, e4m3 byte 0x74 (192),
    codes 3.0 = 5 and 4.0 = 6.
    row 1, [12] * 8 + [7.5] * 8: scaled to 6 (factor 256, step 2) 7.5 -> 3.75 -> 4 (off
    1/2); scaled to 4 (factor 384, step 3) 7.5 -> 2.5 -> 2 (the even code, off 3/2): 6 is
    kept, byte 0x78 (256), codes 6.0 = 7 and 4.0 = 6.
    row 2, [12] * 8 + [-6] * 8: exact both ways (6, -3 or 4, -2): the tie keeps 6."""
    x = torch.tensor([[4.5] * 15 + [6.0], [12.0] * 8 + [7.5] * 8, [12.0] * 8 + [-6.0] * 8])
    q = _q(x)
    assert q.tensor_inv_scale.item() == 1 / 128
    assert _bytes(q.block_inv_scale).flatten().tolist() == [0x74, 0x78, 0x78]
    assert q.block_inv_scale.float().flatten().tolist() == [192.0, 256.0, 256.0]
    codes = e2m1.unpack_e2m1(q.packed)
    assert codes[0].tolist() == [5] * 15 + [6]
    assert codes[1].tolist() == [7] * 8 + [6] * 8
    assert codes[2].tolist() == [7] * 8 + [8 | 5] * 8
    deq = nvfp4.dequantize(q)
    assert torch.equal(deq[0], x[0]) and torch.equal(deq[2], x[2])
    assert deq[1].tolist() == [12.0] * 8 + [8.0] * 8
    # plain NVFP4 of the same rows: amax / (6 * 448), row 0 not exact
    plain = nvfp4.quantize(x, _amax(x))
    assert not torch.equal(nvfp4.dequantize(plain)[0], x[0])


def test_the_256_bound() -> None:
    """The tensor factor is amax / (6 * 256) (float64 math, float32): the amax block's
    factor is 256 scaled to 6 and 384 scaled to 4, both e4m3 values below 448, so no block
    clamps; every factor is at most 384 and the tensor's top values come back exactly."""
    assert nvfp4.FOUR_OVER_SIX_BLOCK_BOUND == 256.0
    assert 256.0 * 6 / 4 == 384.0 == torch.tensor(384.0).to(E4M3).float().item() <= 448
    g = _gen()
    for x in (torch.randn(64, 256, generator=g), _heavy((64, 256), g)):
        for block in nvfp4.BLOCKS:
            amax = _amax(x)
            q = _q(x, amax, block)
            want = (amax.double() / (6 * 256)).float()
            assert torch.equal(q.tensor_inv_scale, want)
            top_blocks = block_amax(x, block) == amax
            assert set(q.block_inv_scale.float()[top_blocks].tolist()) <= {256.0, 384.0}
            assert q.block_inv_scale.float().max().item() <= 384.0
            top = x.abs() == amax
            assert torch.equal(nvfp4.dequantize(q)[top], x[top])
            # stochastic casts round the factors up: the float32 tensor factor may lift a
            # quotient a hair over 256 or 384, rounded up to 288 or 416, still below 448
            sr = _q(x, amax, block, generator=_gen(1))
            assert sr.block_inv_scale.float().max().item() <= 416.0
    # the NVFP4 tensor factor keeps its 448
    assert torch.equal(nvfp4.tensor_inv_scale(torch.tensor(6.0)), torch.tensor(6.0 / 2688))
    # powers of two far from 1 quantize alike, exactly
    q = _q(x, block=nvfp4.WEIGHT_BLOCK)
    for k in (-100, 100):
        qk = _q(x * 2.0**k, _amax(x) * 2.0**k, nvfp4.WEIGHT_BLOCK)
        assert torch.equal(qk.packed, q.packed)
        assert torch.equal(nvfp4.dequantize(qk), nvfp4.dequantize(q) * 2.0**k)


def test_square_tiles_stay_transpose_invariant_and_shards_quantize_as_the_whole() -> None:
    w = _heavy((96, 80), _gen(5)) * 0.02
    amax = _amax(w)
    q, qt = _q(w, amax, nvfp4.WEIGHT_BLOCK), _q(w.t(), amax, nvfp4.WEIGHT_BLOCK)
    flipped = nvfp4.transposed(q)
    assert torch.equal(flipped.packed, qt.packed)
    assert torch.equal(_bytes(flipped.block_inv_scale), _bytes(qt.block_inv_scale))
    # FSDP2 shards of whole 16-row tiles, quantized with the global amax
    for rows in (16, 32, 48):
        shard = _q(w[rows : rows + 32], amax, nvfp4.WEIGHT_BLOCK)
        assert torch.equal(shard.packed, q.packed[rows : rows + 32])
        tiles = slice(rows // 16, rows // 16 + 2)
        assert torch.equal(_bytes(shard.block_inv_scale), _bytes(q.block_inv_scale[tiles]))


def test_non_finite_blocks_stay_nan() -> None:
    x = torch.randn(4, 64, generator=_gen())
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[1, 20] = bad
        deq = nvfp4.dequantize(_q(y, _amax(x)))
        assert deq[1, 16:32].isnan().all() and not deq[0].isnan().any()
        assert nvfp4.dequantize(_q(y)).isnan().all()
    assert torch.equal(nvfp4.dequantize(_q(torch.zeros(4, 64))), torch.zeros(4, 64))


# ------------------------------------------------------------------------ stochastic rounding


def test_stochastic_choice_ignores_the_draws_and_the_cast_is_unbiased() -> None:
    """The factors (rounded up, as NVFP4's stochastic casts round them) are those of the
    round-to-nearest comparison, whatever the draws; identical rows share them, and the
    mean over 2048 rows lies within 5 standard deviations of a Bernoulli draw per element."""
    g = _gen()
    x = torch.randn(1, 128, generator=g) * 3
    rows = x.expand(2048, -1).contiguous()
    a, b = _q(rows, generator=_gen(1)), _q(rows, generator=_gen(2))
    assert torch.equal(_bytes(a.block_inv_scale), _bytes(b.block_inv_scale))
    assert not torch.equal(a.packed, b.packed)
    tensor_inv = nvfp4.tensor_inv_scale(_amax(x), 256.0)
    six, four = (_candidate(x, tensor_inv, (1, 16), t, round_up=True) for t in (6.0, 4.0))
    err6, err4 = _block_sse64(x, six), _block_sse64(x, four)
    want = torch.where(err4 < err6, four.block_inv_scale.float(), six.block_inv_scale.float())
    assert torch.equal(a.block_inv_scale[0].float(), want[0])
    factor = (a.block_inv_scale[0].float() * a.tensor_inv_scale).repeat_interleave(16)
    y = (x[0] / factor).abs()
    assert (y <= 6).all()  # factors rounded up: nothing saturates
    mags = torch.tensor(e2m1.E2M1_MAGNITUDES)
    lower = (y[:, None] >= mags[1:]).sum(-1)
    lo, hi = mags[lower], mags[(lower + 1).clamp(max=7)]
    p = torch.where(hi > lo, (y - lo) / (hi - lo).clamp(min=1e-30), 0.0)
    std = torch.sqrt(p * (1 - p) / 2048) * (hi - lo) * factor
    mean_err = (nvfp4.dequantize(a).mean(0) - x[0]).abs()
    assert (mean_err <= 5 * std + 1e-6 * factor).all()
    # a tensor of draws (the layer's hashed draws) takes the same path as a generator's
    draws = nvfp4.hashed_uniform(rows.shape, torch.tensor(9))
    c = _q(rows, generator=draws)
    assert torch.equal(_bytes(c.block_inv_scale), _bytes(a.block_inv_scale))


# ------------------------------------------------------------------------ SQNR


@pytest.mark.parametrize("kind,block", list(CAST_SQNR_FLOOR_DB))
def test_cast_sqnr(kind, block) -> None:
    g = _gen()
    x = torch.randn(128, 512, generator=g) if kind == "randn" else _heavy((128, 512), g)
    got = sqnr_db(x, nvfp4.dequantize(_q(x, block=block)))
    assert got >= CAST_SQNR_FLOOR_DB[(kind, block)], got
    if (kind, block) == ("randn", (1, 16)):
        plain = sqnr_db(x, nvfp4.dequantize(nvfp4.quantize(x, _amax(x), block)))
        assert got - plain >= GAIN_FLOOR_DB, got - plain
        sr = sqnr_db(x, nvfp4.dequantize(_q(x, block=block, generator=g)))
        assert sr >= SR_SQNR_FLOOR_DB, sr


def _layer(seed: int = 0, **config) -> tuple[nn.Linear, NVFP4Linear]:
    return nvfp4_layer(seed, four_over_six=True, **config)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layer_sqnr_against_high_precision(seed: int) -> None:
    hp, layer = _layer(seed)
    g = _gen(seed)
    x, go = torch.randn(4, 64, 256, generator=g), torch.randn(4, 64, 128, generator=g)
    ref, got = _grads(hp, x, go), _grads(layer, x, go)
    for name, a, b in zip(LAYER_SQNR_FLOOR_DB, ref, got, strict=True):
        assert sqnr_db(a, b) >= LAYER_SQNR_FLOOR_DB[name], (name, sqnr_db(a, b))


def test_each_gemm_is_its_definition() -> None:
    """Round to nearest, no Hadamard transform: each GEMM is the emulated GEMM of its
    operands quantized with four-over-six (the weight once, in 16x16 tiles)."""
    _, layer = _layer(hadamard_grad_weight=False, stochastic_rounding=False)
    assert "four_over_six=True" in repr(layer)
    g = _gen(7)
    x, go = torch.randn(24, 256, generator=g), torch.randn(24, 128, generator=g)
    out, gx, gw = _grads(layer, x, go)
    w = _q(layer.weight.detach(), block=nvfp4.WEIGHT_BLOCK)
    assert torch.equal(out, nvfp4_gemm.emulated_mm(_q(x), w))
    assert torch.equal(gx, torch.mm(nvfp4.dequantize(_q(go)), nvfp4.dequantize(w)))
    go_t, x_t = (torch.nn.functional.pad(t.t(), (0, 8)) for t in (go, x))
    assert torch.equal(gw, nvfp4_gemm.emulated_mm(_q(go_t), _q(x_t)))
    # and they differ from plain NVFP4's
    plain = NVFP4Linear.from_float(
        nn.Linear(256, 128, bias=False),
        NVFP4Config(hadamard_grad_weight=False, stochastic_rounding=False),
    )
    plain.weight = layer.weight
    assert not torch.equal(_grads(plain, x, go)[0], out)


def test_compiled_quantize_equals_eager() -> None:
    """The quantize custom op carries the flag: a compiled graph quantizes as eager does."""
    g = _gen()
    x, draws = torch.randn(32, 64, generator=g), torch.rand(32, 64, generator=g)

    def parts(t, d):
        q = nvfp4.quantize(t, t.abs().amax(), nvfp4.WEIGHT_BLOCK, generator=d, four_over_six=True)
        return q.packed, q.block_inv_scale.view(torch.uint8), q.tensor_inv_scale

    compiled = torch.compile(parts, backend="aot_eager", fullgraph=True)
    for d in (None, draws):
        for a, b in zip(parts(x, d), compiled(x, d), strict=True):
            assert torch.equal(a, b)


def test_refusals() -> None:
    x = torch.randn(4, 32)
    with pytest.raises(TypeError, match="four_over_six must be a bool"):
        nvfp4.quantize(x, _amax(x), four_over_six=1)  # type: ignore[arg-type]
    with pytest.raises(Float8ConfigError, match="four_over_six must be a bool"):
        NVFP4Config(four_over_six="yes")  # type: ignore[arg-type]
