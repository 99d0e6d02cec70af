"""NVFP4 numerics (fsdp_float8.core.nvfp4, its e2m1 codec fsdp_float8.core.e2m1): the e2m1
cast bit for bit against a brute-force nearest-value search written here, nibble packing,
the two-level scales against a per-block reference, the non-finite policy, cast and GEMM
SQNR (randn and heavy-tailed), transpose invariance of 16x16 tiles, stochastic rounding's
expectation against a bound from its variance, and the Hadamard transform's orthogonality.

SQNR thresholds. Measured on CPU (torch 2.13) over seeds 0..31 at the shapes used below
(casts: 128x512; GEMM: (128, 512) @ (64, 512)^T, left operand 1x16, right 16x16); each
floor is mean - 6 * std over those seeds, rounded down to 0.1 dB; each constant's comment
gives the measured mean / std. Six standard deviations leave room for another platform's
float32 summation order while a real loss (a wrong tie rule, a coarser scale) still fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from fsdp_float8.core import e2m1, nvfp4, nvfp4_gemm
from fsdp_float8.core.numerics import sqnr_db
from fsdp_float8.weight_wrappers.nvfp4 import bytes_per_element, payload_bytes

E4M3 = torch.float8_e4m3fn
MAGS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

SQNR_FLOOR_DB = {
    ("randn", (1, 16)): 20.2,  # 20.43 / 0.028
    ("randn", (16, 16)): 18.8,  # 19.06 / 0.029
    ("heavy", (1, 16)): 20.5,  # 21.19 / 0.116
    ("heavy", (16, 16)): 13.8,  # 14.49 / 0.110
}
SR_SQNR_FLOOR_DB = {("randn", (1, 16)): 16.3}  # 16.54 / 0.036 (stochastic rounding)
GEMM_SQNR_FLOOR_DB = {"plain": 16.1, "rht": 16.0}  # randn: 16.66 / 0.090, 16.67 / 0.108
# heavy-tailed GEMM: SQNR with RHT minus without, paired per seed: 2.34 / 0.160
RHT_GAIN_FLOOR_DB = 1.3


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _heavy(shape, g: torch.Generator) -> torch.Tensor:
    """randn * exp(randn): a log-normal scale mixture (kurtosis ~ 3e^4)."""
    return torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g))


def _amax(x: torch.Tensor) -> torch.Tensor:
    return x.abs().max()


# ------------------------------------------------------------------------ the reference


def _ref_code(v: float) -> int:
    """Brute force: the nearest of the 8 magnitudes to |v| saturated at 6, a tie to the
    even code; sign bit 3 (-0.0 included); NaN is +0."""
    if math.isnan(v):
        return 0
    sign = 8 if math.copysign(1.0, v) < 0 else 0
    dist = [abs(min(abs(v), 6.0) - m) for m in MAGS]
    ties = [i for i, d in enumerate(dist) if d == min(dist)]
    return sign | next((i for i in ties if i % 2 == 0), ties[0])


def _ref_codes(y: torch.Tensor) -> torch.Tensor:
    return torch.tensor([_ref_code(v) for v in y.flatten().tolist()], dtype=torch.uint8)


def _edge_values() -> torch.Tensor:
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    mags = torch.tensor(MAGS)
    inf = torch.tensor([math.inf])
    near = torch.cat([mids, mags])
    near = torch.cat([near, torch.nextafter(near, inf), torch.nextafter(near, -inf)])
    f32 = torch.finfo(torch.float32)
    special = [6.5, 7.0, 1e30, f32.max, f32.tiny, 1e-45, 1e-30, math.inf, math.nan, 0.0]
    vals = torch.cat([near, torch.tensor(special)])
    return torch.cat([vals, -vals]).to(torch.float32)


def test_e2m1_cast_equals_brute_force_bit_for_bit() -> None:
    g = _gen()
    random = [torch.rand(2000, generator=g) * 16 - 8, torch.randn(2000, generator=g) * 2]
    y = torch.cat([_edge_values(), *random])
    codes = e2m1.e2m1_codes(y)
    assert codes.dtype == torch.uint8
    assert torch.equal(codes, _ref_codes(y))
    # the decisions the reference makes, spelled out
    spot = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, -0.1, 7.0, -math.inf])
    assert e2m1.e2m1_codes(spot).tolist() == [0, 2, 2, 4, 4, 6, 6, 8, 8, 7, 15]
    values = e2m1.e2m1_values(torch.arange(16, dtype=torch.uint8))
    assert values.tolist() == [*MAGS, *(-m for m in MAGS)] and values[8].signbit()


def test_e2m1_cast_refuses_other_dtypes() -> None:
    with pytest.raises(TypeError, match="float32"):
        e2m1.e2m1_codes(torch.ones(4, dtype=torch.bfloat16))


def test_nibble_packing_layout_and_round_trip() -> None:
    # element 2i in the low nibble: 1.0 (code 2) then -6.0 (code 15) -> 0xF2
    codes = e2m1.e2m1_codes(torch.tensor([[1.0, -6.0, 0.5, 3.0]]))
    packed = e2m1.pack_e2m1(codes)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0xF2, 0x51]]
    f4 = e2m1.as_float4(packed)
    assert f4.dtype == torch.float4_e2m1fn_x2 and f4.view(torch.uint8).tolist() == [[0xF2, 0x51]]
    rand = torch.randint(0, 16, (3, 5, 8), dtype=torch.uint8, generator=_gen())
    assert torch.equal(e2m1.unpack_e2m1(e2m1.pack_e2m1(rand)), rand)
    with pytest.raises(ValueError, match="even last dim"):
        e2m1.pack_e2m1(torch.zeros(2, 3, dtype=torch.uint8))


# ------------------------------------------------------------------------ two-level scales


def _blocks(shape, block):
    for i in range(0, shape[0], block[0]):
        for j in range(0, shape[1], block[1]):
            yield i // block[0], j // block[1], slice(i, i + block[0]), slice(j, j + block[1])


def _e4m3_up(s: float) -> float:
    """The smallest positive e4m3 value >= s, by search over all of them."""
    values = torch.arange(1, 0x7F, dtype=torch.uint8).view(E4M3).float()
    return float(values[values >= s].min())


def _reference_quantize(x, amax: float, block, *, round_up: bool = False):
    """The documented formulas, one block at a time: codes, e4m3 factor bytes, tensor
    factor, dequantized values."""
    tensor_inv = torch.tensor(max(amax, 2688 * 2.0**-117) / 2688, dtype=torch.float32)
    codes = torch.zeros(x.shape, dtype=torch.uint8)
    rows, cols = -(-x.shape[0] // block[0]), -(-x.shape[1] // block[1])
    factors = torch.zeros(rows, cols, dtype=E4M3)
    deq = torch.zeros(x.shape)
    for bi, bj, r, c in _blocks(x.shape, block):
        tile = x[r, c]
        s = float(torch.tensor(float(tile.abs().max()) / (6 * float(tensor_inv))).float())
        s = min(max(s, 2.0**-9), 448.0)
        factor = _e4m3_up(s) if round_up else float(torch.tensor(s).to(E4M3).float())
        factors[bi, bj] = factor
        divisor = torch.tensor(factor * float(tensor_inv), dtype=torch.float32)
        codes[r, c] = _ref_codes(tile / divisor).reshape(tile.shape)
        values = e2m1.e2m1_values(codes[r, c]).double()
        deq[r, c] = (values * factor * float(tensor_inv)).float()
    return codes, factors, tensor_inv, deq


# amax above the local one (an FSDP shard of a larger weight), or below it (a stale amax:
# the clamp at 448 saturates the blocks above it)
@pytest.mark.parametrize("amax_ratio", [1.5, 0.5])
@pytest.mark.parametrize("block", nvfp4.BLOCKS)
def test_quantize_equals_the_per_block_reference(block, amax_ratio) -> None:
    g = _gen()
    x = torch.randn(40, 56, generator=g) * torch.rand(40, 1, generator=g) * 3  # ragged blocks
    x[16:32] *= 1e-5  # block factors in e4m3's subnormals, down to the 2^-9 floor
    amax = float(_amax(x)) * amax_ratio
    q = nvfp4.quantize(x, torch.tensor(amax), block)
    codes, factors, tensor_inv, deq = _reference_quantize(x, amax, block)
    assert q.shape == x.shape and q.packed.shape == (40, 28)
    assert torch.equal(e2m1.unpack_e2m1(q.packed), codes)
    assert torch.equal(q.block_inv_scale.view(torch.uint8), factors.view(torch.uint8))
    assert torch.equal(q.tensor_inv_scale, tensor_inv)
    assert torch.equal(nvfp4.dequantize(q), deq)
    # stochastic casts round the block factors up
    sr = nvfp4.quantize(x, torch.tensor(amax), block, generator=_gen(1))
    _, up, _, _ = _reference_quantize(x, amax, block, round_up=True)
    assert torch.equal(sr.block_inv_scale.view(torch.uint8), up.view(torch.uint8))


def test_the_tensor_amax_block_gets_the_top_e4m3_factor_and_scale_is_exact_in_powers_of_2():
    x = torch.randn(32, 64, generator=_gen())
    q = nvfp4.quantize(x, _amax(x), nvfp4.WEIGHT_BLOCK)
    assert float(q.block_inv_scale.float().max()) == 448.0
    # tiny and huge tensors (amax far from 1, above the floor) quantize alike, exactly
    for k in (-100, 100):
        qk = nvfp4.quantize(x * 2.0**k, _amax(x) * 2.0**k, nvfp4.WEIGHT_BLOCK)
        assert torch.equal(qk.packed, q.packed)
        assert torch.equal(nvfp4.dequantize(qk), nvfp4.dequantize(q) * 2.0**k)


def test_non_finite_policy() -> None:
    x = torch.randn(4, 64, generator=_gen())
    amax = _amax(x)
    clean = nvfp4.dequantize(nvfp4.quantize(x, amax))
    zeros = nvfp4.quantize(torch.zeros(4, 64), torch.tensor(0.0))
    assert torch.equal(nvfp4.dequantize(zeros), torch.zeros(4, 64))
    for bad in (math.nan, math.inf, -math.inf):
        y = x.clone()
        y[1, 20] = bad
        deq = nvfp4.dequantize(nvfp4.quantize(y, amax))  # a finite amax passed in
        assert deq[1, 16:32].isnan().all()  # the block holding it is NaN ...
        others = torch.ones_like(deq, dtype=torch.bool)
        others[1, 16:32] = False
        assert torch.equal(deq[others], clean[others])  # ... the rest as before
        # the tensor's own amax is then non-finite: all of it dequantizes to NaN
        assert nvfp4.dequantize(nvfp4.quantize(y, _amax(y))).isnan().all()


def test_quantize_refuses_bad_input() -> None:
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match=r"\(1, 16\)"):
        nvfp4.quantize(x, _amax(x), (1, 32))
    with pytest.raises(ValueError, match="even last dim"):
        nvfp4.quantize(torch.randn(4, 31), _amax(x))
    with pytest.raises(TypeError, match="one-element"):
        nvfp4.quantize(x, x.abs().amax(dim=1))
    with pytest.raises(ValueError, match="square tiles"):
        nvfp4.transposed(nvfp4.quantize(x, _amax(x)))


# ------------------------------------------------------------------------ SQNR


@pytest.mark.parametrize("kind,block", list(SQNR_FLOOR_DB))
def test_cast_sqnr(kind, block) -> None:
    g = _gen()
    x = torch.randn(128, 512, generator=g) if kind == "randn" else _heavy((128, 512), g)
    got = sqnr_db(x, nvfp4.dequantize(nvfp4.quantize(x, _amax(x), block)))
    assert got >= SQNR_FLOOR_DB[(kind, block)], got
    if (kind, block) in SR_SQNR_FLOOR_DB:
        sr = nvfp4.dequantize(nvfp4.quantize(x, _amax(x), block, generator=g))
        assert sqnr_db(x, sr) >= SR_SQNR_FLOOR_DB[(kind, block)], sqnr_db(x, sr)


def _gemm(a, b, matrix=None):
    if matrix is not None:
        a, b = nvfp4.rht(a, matrix), nvfp4.rht(b, matrix)
    qa, qb = nvfp4.quantize(a, _amax(a)), nvfp4.quantize(b, _amax(b), nvfp4.WEIGHT_BLOCK)
    out = nvfp4_gemm.emulated_mm(qa, qb)
    assert torch.equal(out, nvfp4.dequantize(qa) @ nvfp4.dequantize(qb).t())
    return out


def test_emulated_gemm_sqnr_with_and_without_rht() -> None:
    g = _gen()
    matrix = nvfp4.random_hadamard(g)
    a, b = torch.randn(128, 512, generator=g), torch.randn(64, 512, generator=g)
    ref = a @ b.t()
    assert sqnr_db(ref, _gemm(a, b)) >= GEMM_SQNR_FLOOR_DB["plain"]
    assert sqnr_db(ref, _gemm(a, b, matrix)) >= GEMM_SQNR_FLOOR_DB["rht"]
    # heavy tails: the transform spreads each block's outliers, and that shows
    a, b = _heavy((128, 512), g), _heavy((64, 512), g)
    ref = a @ b.t()
    gain = sqnr_db(ref, _gemm(a, b, matrix)) - sqnr_db(ref, _gemm(a, b))
    assert gain >= RHT_GAIN_FLOOR_DB, gain
    with pytest.raises(ValueError, match="same K"):
        nvfp4_gemm.emulated_mm(nvfp4.quantize(a, _amax(a)), nvfp4.quantize(a[:, :32], _amax(a)))


# ------------------------------------------------------------------------ 16x16 tiles


def test_square_tiles_are_transpose_invariant() -> None:
    w = torch.randn(48, 80, generator=_gen()) * 0.02
    amax = _amax(w)
    q, qt = nvfp4.quantize(w, amax, nvfp4.WEIGHT_BLOCK), nvfp4.quantize(w.t(), amax, (16, 16))
    flipped = nvfp4.transposed(q)
    assert torch.equal(flipped.packed, qt.packed)
    assert torch.equal(
        flipped.block_inv_scale.view(torch.uint8), qt.block_inv_scale.view(torch.uint8)
    )
    assert torch.equal(nvfp4.dequantize(qt), nvfp4.dequantize(q).t())
    # 1x16 blocks are not: the same check fails for them
    row, col = nvfp4.quantize(w, amax), nvfp4.quantize(w.t(), amax)
    assert not torch.equal(nvfp4.dequantize(col), nvfp4.dequantize(row).t())


# ------------------------------------------------------------------------ stochastic rounding


def _bound(mean_err, p, gap, n, sigmas=5.0):
    """|mean of n draws - value| <= sigmas * sqrt(p (1 - p) gap^2 / n) for each element (a
    draw is lower + gap * Bernoulli(p)); exact where p is 0."""
    return mean_err.abs() <= sigmas * torch.sqrt(p * (1 - p) * gap**2 / n) + 1e-6 * gap


def _neighbours(mag: torch.Tensor):
    mags = torch.tensor(MAGS)
    lower = (mag[..., None] >= mags[1:]).sum(-1)
    lo, hi = mags[lower], mags[(lower + 1).clamp(max=7)]
    gap = hi - lo
    p = torch.where(gap > 0, (mag.clamp(max=6) - lo) / gap.clamp(min=1e-30), 0.0)
    return p, gap


def test_stochastic_e2m1_is_unbiased_within_its_variance() -> None:
    n = 4096
    grid = torch.tensor(
        [lo + k / 8 * (hi - lo) for lo, hi in zip(MAGS, MAGS[1:]) for k in range(8)]
    )
    y = torch.cat([grid, torch.tensor([6.0]), -grid])
    draws = e2m1.e2m1_values(e2m1.e2m1_codes(y.expand(n, -1).contiguous(), generator=_gen()))
    p, gap = _neighbours(y.abs())
    assert _bound(draws.mean(0) - y, p, gap, n).all()
    # exactly representable values never move; the others take both neighbours
    exact = p == 0
    assert (draws[:, exact] == y[exact]).all()
    assert (draws[:, ~exact].std(0) > 0).all()


def test_stochastic_quantize_is_unbiased_and_reproducible() -> None:
    n, g = 2048, _gen()
    x = torch.randn(1, 128, generator=g) * 3
    rows = x.expand(n, -1).contiguous()  # identical rows: identical 1x16 block factors
    q = nvfp4.quantize(rows, _amax(x), generator=_gen(1))
    draws = nvfp4.dequantize(q)
    factor = (q.block_inv_scale[0].float() * q.tensor_inv_scale).repeat_interleave(16)
    y = x[0] / factor  # the scaled element, in e2m1 units
    assert (y.abs() <= 6).all()  # factors rounded up: nothing saturates
    p, gap = _neighbours(y.abs())
    assert _bound(draws.mean(0) - x[0], p, gap * factor, n).all()
    again = nvfp4.quantize(rows, _amax(x), generator=_gen(1))
    other = nvfp4.quantize(rows, _amax(x), generator=_gen(2))
    assert torch.equal(again.packed, q.packed) and not torch.equal(other.packed, q.packed)


# ------------------------------------------------------------------------ Hadamard transform


def test_random_hadamard_is_orthogonal_seeded_and_keeps_gemms() -> None:
    m = nvfp4.random_hadamard(_gen(3))
    assert torch.equal(m @ m.t(), torch.eye(16))  # +-1/4 entries: exact in float32
    assert torch.equal(m, nvfp4.random_hadamard(_gen(3)))
    assert not torch.equal(m, nvfp4.random_hadamard(_gen(4)))
    g = _gen()
    a, b = torch.randn(8, 64, generator=g).double(), torch.randn(5, 64, generator=g).double()
    assert torch.allclose(nvfp4.inverse_rht(nvfp4.rht(a, m), m), a, rtol=0, atol=1e-12)
    # (a R)(b R)^T = a b^T: grad_weight = dy^T x transformed along the token dim
    ra, rb = nvfp4.rht(a, m), nvfp4.rht(b, m)
    assert torch.allclose(ra @ rb.t(), a @ b.t(), rtol=0, atol=1e-12)
    assert not torch.allclose(ra, a)
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.rht(torch.randn(2, 24), m)


# ------------------------------------------------------------------------ payload


def test_payload_bytes() -> None:
    assert bytes_per_element(nvfp4.WEIGHT_BLOCK) == 0.5 + 1 / 256
    assert bytes_per_element(nvfp4.ACTIVATION_BLOCK) == 0.5625
    assert payload_bytes((256, 512), (16, 16)) == 256 * 512 * (0.5 + 1 / 256)
    assert payload_bytes((256, 512), (1, 16)) == 256 * 512 * 0.5625
    # partial blocks count whole: 20x40 -> 2x3 tiles, 20x3 rows of blocks
    assert payload_bytes((20, 40), (16, 16)) == 20 * 20 + 6
    assert payload_bytes((2, 20, 40), (1, 16)) == 2 * (20 * 20 + 60)
    # and it is what a quantized tensor holds
    q = nvfp4.quantize(torch.randn(20, 40), torch.tensor(4.0), (16, 16))
    assert q.packed.numel() + q.block_inv_scale.numel() == payload_bytes((20, 40), (16, 16))


def test_hashed_uniform_draws() -> None:
    """Counter-based draws: multiples of 2^-24 in [0, 1), the same for the same salt, other
    for another; 2^16 draws fill 16 equal bins within 5 standard deviations of a binomial
    count (256 * 16 / 16 = 4096 expected, std 62), and so do 4096 salts at one index."""
    a = nvfp4.hashed_uniform((256, 256), torch.tensor(7))
    assert torch.equal(a, nvfp4.hashed_uniform((256, 256), torch.tensor(7)))
    assert (a != nvfp4.hashed_uniform((256, 256), torch.tensor(8))).float().mean() > 0.99
    assert a.min() >= 0 and a.max() < 1 and torch.equal(a * 2**24, (a * 2**24).round())
    expected, std = 4096, math.sqrt(2**16 * (1 / 16) * (15 / 16))
    counts = torch.histc(a, bins=16, min=0, max=1)
    assert ((counts - expected).abs() <= 5 * std).all(), counts
    across = torch.stack([nvfp4.hashed_uniform((16,), torch.tensor(s))[3] for s in range(4096)])
    counts = torch.histc(across, bins=16, min=0, max=1)
    expected, std = 256, math.sqrt(4096 * (1 / 16) * (15 / 16))
    assert ((counts - expected).abs() <= 5 * std).all(), counts
