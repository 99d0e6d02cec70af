"""NVFP4 numerics: two-level scales, quantize and dequantize, the Hadamard transform. The
e2m1 element codec (codes, rounding, packing) is `core/e2m1.py`'s; the GEMMs on NVFP4
operands are `core/nvfp4_gemm.py`'s.

Mental model. An NVFP4 tensor is 4-bit e2m1 codes (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6;
a sign bit), two per byte, times two dequantization factors: one e4m3 per block of 16
elements (1x16 along the contraction dim for activations and gradients, 16x16 tiles for
weights) and one float32 for the whole tensor. Both factors *dequantize* (hp ~= e2m1 *
block_inv_scale * tensor_inv_scale), the `inv_scale` of `fsdp_float8.core.float8_tensor`:
an e4m3 block factor is what a Blackwell block-scaled GEMM multiplies by, and its reciprocal
is not an e4m3 value.

Scales (amax = the tensor's max |x|, an input, so FSDP ranks holding shards pass the
MAX-reduced amax of the whole weight and all quantize alike):
- tensor_inv_scale = max(amax, TENSOR_AMAX_FLOOR) / (6 * 448), float64 math, stored float32.
  It maps the tensor's amax to the top of e4m3 times the top of e2m1: a block whose amax is
  the tensor's gets the block factor 448, and every other block a factor in e4m3's range.
  The floor keeps it at least 2^-117, so a block factor (>= 2^-9) times it is a normal
  float32 (an all-zero tensor quantizes to zeros with this factor).
- block_inv_scale = block_amax / (6 * tensor_inv_scale) (float64 math, then float32),
  clamped to [2^-9, 448] and made e4m3 (2^-9: e4m3's smallest subnormal, so no block factor
  is 0 and a block with a tiny amax keeps what precision it can). Round-to-nearest casts
  take the nearest e4m3 value (the best SQNR; the block's largest element may then scale up
  to 6 * (1 + 1/16) for a normal factor, and saturate to 6). Stochastic casts round the
  factor *up* to the next e4m3 value, so no element saturates (up to float32 rounding of
  the divisor) and the cast is unbiased for every element. Rounding up costs round-to-
  nearest casts SQNR (randn 256x1024 in 1x16 blocks, torch 2.13 CPU: 20.43 dB with the
  nearest factor, 19.97 dB rounded up), so only stochastic casts do it.
  The clamp at 448 acts only when the amax passed is below a block's own (a caller's stale
  amax): that block saturates, as the float8 casts do.
- the element cast sees x / float32(block_inv_scale * tensor_inv_scale), clamped to [-6, 6].

Four-over-six (`quantize(..., four_over_six=True)`, `NVFP4Config(four_over_six=True)`): each
block is encoded twice, with the block factor that maps its amax to 6 (as above) and with
the one that maps it to 4 (block_amax / (4 * tensor_inv_scale)); the encoding whose sum of
squared dequantization errors over the block (float32) is smaller is kept, per block (a tie
keeps 6). Scaled to 4 a block uses the codes up to 4 only, its top values on the steps 3, 4
instead of 4, 6: a block whose values sit near 5/6 of its amax loses less. The tensor factor
is t = max(amax, TENSOR_AMAX_FLOOR) / (6 * b) with b = 256 (`tensor_inv_scale`'s bound).
Derivation: a block's amax is at most the amax passed, so its 6-factor block_amax / (6 t)
is at most b = 256 and its 4-factor block_amax / (4 t) at most 6 b / 4 = 384, both e4m3
values below 448: no candidate clamps. (t is rounded to float32, which may put a quotient a
hair above its bound: rounded to nearest it is still 256 or 384, rounded up, for stochastic
casts, at most 288 or 416.) The condition is 1.5 b <= 448 (b <= 298.7); 256 is the recipe's
bound, a power of two. The format is NVFP4's: dequantization and the GEMMs are unchanged.
With stochastic rounding both candidates' factors are rounded up and the choice compares
their round-to-nearest errors, so it does not depend on the draws; the chosen encoding is
then cast stochastically, as unbiased as NVFP4's. For 16x16 tiles each candidate's error is
the sum over the tile's rows then columns plus the sum over its columns then rows, each
added in a fixed order, so the choice, and `transposed(quantize(W))` == `quantize(W.T)`,
holds bit for bit.

Rounding and packing are the e2m1 codec's (`core/e2m1.py`): to nearest even, or
stochastic from a `torch.Generator` or given draws; two codes per byte, low nibble first.
Non-finite policy: e2m1 has no inf or NaN (the raw cast saturates +-inf to +-6 and maps NaN
to +0); `quantize` carries them in the scales: a block holding inf or NaN gets a NaN block
factor and dequantizes to NaN entirely, and a non-finite amax makes the tensor factor
non-finite, so the whole tensor dequantizes to NaN (nothing is silently finite).

16x16 tiles are transpose-invariant: `transposed(quantize(W))` equals `quantize(W.T)` bit
for bit, so one quantized weight serves the forward (contracting W's columns) and the
grad_input GEMM (contracting its rows).

Random Hadamard transform (RHT, `core/randomized.py`): R = D @ H / 4, D a seeded random +-1 diagonal and H the
16x16 Sylvester Hadamard matrix, applied to each run of 16 elements along the last dim.
R is orthogonal, so (a R)(b R)^T = a b^T: applied along the contraction dim of both
operands of a GEMM (grad_weight's token dim) it leaves the product unchanged while spreading
outliers across each block before the cast.

All-gather payload: packed nibbles plus one e4m3 byte per block, 0.5 + 1/256 bytes per
element for 16x16 tiles and 0.5 + 1/16 for 1x16, plus one float32 per tensor
(`weight_wrappers/nvfp4.py` counts them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_float8.core.blocks import Block, blocked, expand_block_scale, scale_shape
from fsdp_float8.core.e2m1 import E2M1_MAX, e2m1_codes, e2m1_values, pack_e2m1, unpack_e2m1
from fsdp_float8.core.randomized import (  # noqa: F401  (part of this API)
    RHT_SIZE,
    hashed_uniform,
    inverse_rht,
    random_hadamard,
    rht,
)
from fsdp_float8.core.scaling import block_amax, tensor_amax

E4M3_MAX = 448.0
E4M3 = torch.float8_e4m3fn
ACTIVATION_BLOCK: Block = (1, 16)  # activations and gradients: along the contraction dim
WEIGHT_BLOCK: Block = (16, 16)  # weights: one tile serves both of a weight's GEMMs
BLOCKS = (ACTIVATION_BLOCK, WEIGHT_BLOCK)
BLOCK_INV_SCALE_MIN = 2.0**-9  # e4m3's smallest subnormal
TENSOR_AMAX_FLOOR = E2M1_MAX * E4M3_MAX * 2.0**-117  # tensor_inv_scale >= 2^-117
# four-over-six: the e4m3 block factor of the tensor's amax block scaled to 6; scaled to 4
# it is 256 * 6 / 4 = 384 <= 448, so neither candidate clamps (the module docstring derives it)
FOUR_OVER_SIX_BLOCK_BOUND = 256.0
FOUR_OVER_SIX_TARGETS = (E2M1_MAX, 4.0)  # the two block amax targets, 6 first (ties keep it)


# ------------------------------------------------------------------------ two-level scales


@dataclass(frozen=True)
class NVFP4:
    """A quantized tensor: `packed` uint8 (..., R, C / 2), `block_inv_scale` e4m3 with one
    entry per `block` of the (..., R, C) tensor, `tensor_inv_scale` a 0-d float32. Both
    scales dequantize (the module docstring)."""

    packed: torch.Tensor
    block_inv_scale: torch.Tensor
    tensor_inv_scale: torch.Tensor
    block: Block

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.packed.shape[:-1], 2 * self.packed.shape[-1]))


def tensor_inv_scale(amax: torch.Tensor, block_bound: float = E4M3_MAX) -> torch.Tensor:
    """max(amax, TENSOR_AMAX_FLOOR) / (6 * block_bound): float64 math, 0-d float32 (NaN
    stays NaN). block_bound is the block factor of the tensor's amax block: 448 for NVFP4,
    FOUR_OVER_SIX_BLOCK_BOUND (256) for four-over-six. Both keep the factor >= 2^-117."""
    amax64 = amax.detach().reshape(()).to(torch.float64)
    return (amax64.clamp(min=TENSOR_AMAX_FLOOR) / (E2M1_MAX * block_bound)).to(torch.float32)


def _e4m3_round_up(s: torch.Tensor) -> torch.Tensor:
    """s (float32, in [2^-9, 448]) as the smallest e4m3 value >= s; NaN stays NaN."""
    nearest = s.to(E4M3)
    below = nearest.to(torch.float32) < s  # positive e4m3 bit patterns are monotone
    return (nearest.view(torch.uint8) + below.to(torch.uint8)).view(E4M3)


def block_inv_scales(
    block_amaxes: torch.Tensor,
    tensor_inv: torch.Tensor,
    *,
    round_up: bool = False,
    target: float = E2M1_MAX,
) -> torch.Tensor:
    """e4m3 block factors: block_amax / (target * tensor_inv) within [2^-9, 448], the
    nearest e4m3 value or (`round_up`) the next one up; NaN for a non-finite block amax.
    `target` is what a block's amax scales to: 6 (NVFP4), or 4 (four-over-six's other)."""
    s = block_amaxes.to(torch.float64) / (target * tensor_inv.to(torch.float64))
    s = s.to(torch.float32).clamp(min=BLOCK_INV_SCALE_MIN, max=E4M3_MAX)
    s = torch.where(torch.isfinite(block_amaxes), s, torch.nan)
    return _e4m3_round_up(s) if round_up else s.to(E4M3)


def _check_quantize(x: torch.Tensor, amax: torch.Tensor, block: Block) -> None:
    if block not in BLOCKS:
        raise ValueError(
            f"NVFP4 blocks are {ACTIVATION_BLOCK} (activations, gradients) or "
            f"{WEIGHT_BLOCK} (weights), got {block!r}"
        )
    if not x.is_floating_point() or x.dim() < 2 or x.shape[-1] % 2:
        raise ValueError(
            f"NVFP4 quantizes a floating tensor of >= 2 dims with an even last dim, got "
            f"{x.dtype} of shape {tuple(x.shape)}; reshape to (rows, cols) or pad cols"
        )
    if not isinstance(amax, torch.Tensor) or amax.numel() != 1 or not amax.is_floating_point():
        raise TypeError(
            f"amax must be a one-element floating tensor (max |x| of the whole tensor, "
            f"MAX-reduced over ranks holding shards), got {amax!r}"
        )
    if amax.device != x.device:
        raise ValueError(f"amax is on {amax.device} but x on {x.device}; move it to x's")


def quantize(
    x: torch.Tensor,
    amax: torch.Tensor,
    block: Block = ACTIVATION_BLOCK,
    *,
    generator: torch.Generator | torch.Tensor | None = None,
    four_over_six: bool = False,
) -> NVFP4:
    """x (..., R, C) in blocks of `block` along its last two dims (a partial last block
    counts as zero-padded), with the tensor factor of `amax`; stochastic rounding with
    `generator` (block factors rounded up; a torch.Generator or uniform draws shaped like
    x, e.g. `hashed_uniform`), else round to nearest even (nearest factors).
    `four_over_six`: each block scaled to 6 or to 4, whichever dequantizes closer (the
    module docstring), with the tensor factor amax / (6 * 256)."""
    _check_quantize(x, amax, block)
    if type(four_over_six) is not bool:
        raise TypeError(f"four_over_six must be a bool, got {four_over_six!r}")
    # draws (a tensor) or none: one op, so that a compiled graph quantizes as eager does,
    # bit for bit; a torch.Generator (eager only: its state) takes the Python path. The
    # tensor test comes first: torch 2.15's Dynamo refuses isinstance(tensor, Generator)
    parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    if generator is None or isinstance(generator, torch.Tensor):
        parts = quantize_op(x.detach(), amax.detach(), block[0], block[1], generator, four_over_six)
    else:
        parts = _quantize_parts(x.detach(), amax.detach(), *block, generator, four_over_six)
    return NVFP4(*parts, block)


def quantize_per_matrix(x: torch.Tensor, *, four_over_six: bool = False) -> NVFP4:
    """x (E, R, C), a stack of E matrices (an experts weight), each quantized on its own in
    16x16 tiles with its own amax: `quantize(x[e], amax(x[e]), WEIGHT_BLOCK)` for each e,
    stacked. The record's `tensor_inv_scale` is (E,), one factor per matrix (`matrix`
    takes one out as a 2-D record). A shard of whole matrices quantizes as the whole does."""
    if x.dim() != 3:
        raise ValueError(
            f"quantize_per_matrix takes a stack of matrices (E, R, C), got shape "
            f"{tuple(x.shape)}; quantize a 2-D weight with quantize(w, amax, WEIGHT_BLOCK)"
        )
    rows, cols = x.shape[1:]
    parts = [
        quantize(m, tensor_amax(m).reshape(()), WEIGHT_BLOCK, four_over_six=four_over_six)
        for m in x.unbind(0)
    ]
    if not parts:  # no matrix: empty fields of the stacked shapes
        tiles = x.new_empty((0, *scale_shape((rows, cols), WEIGHT_BLOCK)), dtype=E4M3)
        packed = x.new_empty((0, rows, cols // 2), dtype=torch.uint8)
        return NVFP4(packed, tiles, x.new_empty((0,), dtype=torch.float32), WEIGHT_BLOCK)
    return NVFP4(
        torch.stack([q.packed for q in parts]),
        torch.stack([q.block_inv_scale for q in parts]),
        torch.stack([q.tensor_inv_scale.reshape(()) for q in parts]),
        WEIGHT_BLOCK,
    )


def matrix(q: NVFP4, e: int) -> NVFP4:
    """Matrix `e` of a `quantize_per_matrix` record, as a 2-D record (views, no copy)."""
    return NVFP4(q.packed[e], q.block_inv_scale[e], q.tensor_inv_scale[e], q.block)


def _encode(
    hp: torch.Tensor,
    block_inv: torch.Tensor,
    tensor_inv: torch.Tensor,
    block: Block,
    draws: torch.Tensor | torch.Generator | None,
) -> torch.Tensor:
    """The e2m1 codes of hp with these factors (round to nearest, or with `draws`)."""
    per_element = expand_block_scale(block_inv.to(torch.float32) * tensor_inv, block, hp.shape)
    return e2m1_codes(hp / per_element, generator=draws)


def _ordered_sum(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t summed along `dim`, adding its slices one by one in index order (no reduction
    kernel, whose order may depend on strides and sizes)."""
    total = t.select(dim, 0)
    for i in range(1, t.shape[dim]):
        total = total + t.select(dim, i)
    return total


def block_squared_error(
    hp: torch.Tensor, codes: torch.Tensor, block_inv: torch.Tensor, tensor_inv: torch.Tensor,
    block: Block,
) -> torch.Tensor:  # fmt: skip
    """Per block of `block`: the squared errors (float32) of the codes dequantized as
    `dequantize` does against hp, summed over the block's rows then columns plus over its
    columns then rows, each in index order: twice the block's sum of squared errors, the
    same bits for a tile and its transpose. In the block factors' shape."""
    values = expand_block_scale(block_inv.to(torch.float32), block, hp.shape)
    err = (e2m1_values(codes) * values) * tensor_inv - hp
    sq = blocked(err * err, block)  # (..., R/br, br, C/bc, bc)
    by_rows = _ordered_sum(_ordered_sum(sq, -1), -2)
    if block[0] == 1:  # one row: the column-first sum adds the same values in the same order
        return by_rows + by_rows
    by_cols = _ordered_sum(_ordered_sum(sq, -3), -1)
    return by_rows + by_cols


def _quantize_parts(
    x: torch.Tensor,
    amax: torch.Tensor,
    block_rows: int,
    block_cols: int,
    draws: torch.Tensor | torch.Generator | None,
    four_over_six: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    block = (block_rows, block_cols)
    hp = x.to(torch.float32)
    amaxes = block_amax(hp, block)
    round_up = draws is not None
    if not four_over_six:
        tensor_inv = tensor_inv_scale(amax)
        block_inv = block_inv_scales(amaxes, tensor_inv, round_up=round_up)
        # `_encode`, written out: the default path is every NVFP4 cast of a step
        per_element = expand_block_scale(block_inv.to(torch.float32) * tensor_inv, block, hp.shape)
        return pack_e2m1(e2m1_codes(hp / per_element, generator=draws)), block_inv, tensor_inv
    tensor_inv = tensor_inv_scale(amax, FOUR_OVER_SIX_BLOCK_BOUND)
    candidates = []  # (block factors, round-to-nearest codes, block errors), 6 then 4
    for target in FOUR_OVER_SIX_TARGETS:
        factors = block_inv_scales(amaxes, tensor_inv, round_up=round_up, target=target)
        codes = _encode(hp, factors, tensor_inv, block, None)
        candidates.append(
            (factors, codes, block_squared_error(hp, codes, factors, tensor_inv, block))
        )
    (six, six_codes, six_err), (four, four_codes, four_err) = candidates
    use_four = four_err < six_err  # NaN (a non-finite block) keeps 6, as does a tie
    block_inv = torch.where(use_four, four.view(torch.uint8), six.view(torch.uint8)).view(E4M3)
    if round_up:  # the chosen factors, now cast with the draws
        codes = _encode(hp, block_inv, tensor_inv, block, draws)
    else:
        codes = torch.where(expand_block_scale(use_four, block, hp.shape), four_codes, six_codes)
    return pack_e2m1(codes), block_inv, tensor_inv


def _quantize_op_impl(
    x: torch.Tensor,
    amax: torch.Tensor,
    block_rows: int,
    block_cols: int,
    draws: torch.Tensor | None,
    four_over_six: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _quantize_parts(x, amax, block_rows, block_cols, draws, four_over_six)


# The quantize is a custom op: torch.compile calls it as eager runs it. Inductor would
# otherwise fuse its e2m1 rounding with its neighbours, where the CPU backend's loop split
# fails on the tile reshapes and a fused kernel need not round as eager does.
quantize_op = torch.library.custom_op("fsdp_float8::nvfp4_quantize", mutates_args=())(
    _quantize_op_impl
)


@quantize_op.register_fake
def _quantize_op_fake(x, amax, block_rows, block_cols, draws, four_over_six=False):
    *lead, rows, cols = x.shape
    packed = x.new_empty((*lead, rows, cols // 2), dtype=torch.uint8)
    block_inv = x.new_empty(scale_shape(x.shape, (block_rows, block_cols)), dtype=E4M3)
    return packed, block_inv, x.new_empty((), dtype=torch.float32)


def dequantize(q: NVFP4) -> torch.Tensor:
    """float32 (e2m1 * block factor, exact) * tensor factor: one rounding per element."""
    values = e2m1_values(unpack_e2m1(q.packed))
    block_inv = expand_block_scale(q.block_inv_scale.to(torch.float32), q.block, values.shape)
    return (values * block_inv) * q.tensor_inv_scale


def transposed(q: NVFP4) -> NVFP4:
    """The quantized transpose of a square-tiled tensor: codes and tile factors transposed
    (exact), equal to quantizing the transpose."""
    if q.block[0] != q.block[1]:
        raise ValueError(
            f"only square tiles are transpose-invariant, got {q.block}; quantize the "
            f"transpose itself, or quantize with block={WEIGHT_BLOCK}"
        )
    codes = unpack_e2m1(q.packed).transpose(-2, -1)
    block_inv = q.block_inv_scale.transpose(-2, -1).contiguous()
    return NVFP4(pack_e2m1(codes.contiguous()), block_inv, q.tensor_inv_scale, q.block)
