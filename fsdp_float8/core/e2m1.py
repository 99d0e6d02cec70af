"""The e2m1 (FP4) element codec: 4-bit codes, their values, two codes per byte.

An e2m1 code is a sign bit (bit 3) over a magnitude code 0..7, the magnitudes 0, 0.5, 1,
1.5, 2, 3, 4, 6. The cast takes float32 values already scaled into [-6, 6] (by the caller's
block and tensor factors); beyond it saturates.

Rounding: to nearest, ties to the even code (the mantissa bit 0), or stochastic (round up
with probability equal to the distance from the lower neighbour over the gap, from a
`torch.Generator`: unbiased, reproducible). Zero keeps its sign (-0.0 is code 0b1000, as is
a negative value that rounds to zero). Non-finite policy: e2m1 has no inf or NaN. The raw
cast saturates +-inf to +-6 and maps NaN to +0.

Packing: element 2i in the low nibble, 2i+1 in the high nibble of byte i along the last dim,
the layout of `torch.float4_e2m1fn_x2` (`as_float4` views the bytes as that dtype).
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
FLOAT4 = torch.float4_e2m1fn_x2
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code 0..7; bit 3 is the sign

# the midpoints between neighbouring magnitudes; crossing midpoint i moves code i to i + 1
_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_MAGNITUDES, E2M1_MAGNITUDES[1:]))


def _table(device: torch.device) -> torch.Tensor:
    """float32 value of each of the 16 codes (code 8 is -0.0)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


# ------------------------------------------------------------------------ the e2m1 cast


def _rne_magnitude_codes(mag: torch.Tensor) -> torch.Tensor:
    """Nearest magnitude code, ties to the even code; > 6 and inf give 7, NaN gives 0."""
    code = torch.zeros(mag.shape, dtype=torch.uint8, device=mag.device)
    for i, mid in enumerate(_MIDPOINTS):
        # a tie at midpoint i belongs to the even one of codes i and i + 1
        code += (mag >= mid) if i % 2 else (mag > mid)
    return code


def _draws(mag: torch.Tensor, random: torch.Generator | torch.Tensor) -> torch.Tensor:
    """Uniform draws in [0, 1), one per element: from a generator, or given (`hashed_uniform`)."""
    if isinstance(random, torch.Tensor):
        if random.shape != mag.shape or random.device != mag.device:
            raise ValueError(
                f"stochastic rounding of a {tuple(mag.shape)} tensor on {mag.device} got draws "
                f"of shape {tuple(random.shape)} on {random.device}; pass one per element"
            )
        return random
    if random.device.type != mag.device.type:
        raise ValueError(
            f"stochastic rounding of a tensor on {mag.device} got a generator on "
            f"{random.device}; pass torch.Generator(device={str(mag.device)!r})"
        )
    return torch.rand(mag.shape, generator=random, device=mag.device)


def _stochastic_magnitude_codes(
    mag: torch.Tensor, random: torch.Generator | torch.Tensor
) -> torch.Tensor:
    """The lower neighbour's code, plus 1 with probability (mag - lower) / gap. The
    difference and the division are exact in float32 (Sterbenz; the gaps are powers of two),
    and the draws are multiples of 2^-24, so the bias is below 2^-24 of a gap."""
    draw = _draws(mag, random)
    lower = torch.zeros(mag.shape, dtype=torch.uint8, device=mag.device)
    for m in E2M1_MAGNITUDES[1:]:
        lower += mag >= m
    table = _table(mag.device)
    lo = table[lower.long()]
    gap = table[(lower.long() + 1).clamp(max=7)] - lo
    frac = torch.where(gap > 0, (mag - lo) / torch.where(gap > 0, gap, 1.0), 0.0)
    return lower + (draw < frac).to(torch.uint8)


def e2m1_codes(
    y: torch.Tensor, *, generator: torch.Generator | torch.Tensor | None = None
) -> torch.Tensor:
    """uint8 e2m1 codes (0..15, sign in bit 3), one per element of a float32 `y` already
    scaled into [-6, 6] (beyond it saturates). Round to nearest even, or stochastically
    with `generator` (a torch.Generator, or a tensor of uniform draws shaped like `y`).
    See the module docstring for zeros and non-finite values."""
    if y.dtype != torch.float32:
        raise TypeError(f"e2m1_codes takes float32, got {y.dtype}; convert with .float()")
    mag = y.abs()
    if generator is None:
        code = _rne_magnitude_codes(mag)
    else:
        code = _stochastic_magnitude_codes(mag, generator)
    negative = torch.signbit(y) & ~torch.isnan(y)
    return code | (negative.to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 codes (exact): `_table`, written out (every dequantize)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    return torch.cat([mags, -mags])[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Codes (..., n) -> uint8 (..., n / 2): element 2i in the low nibble of byte i."""
    if codes.shape[-1] % 2:
        raise ValueError(
            f"packing two e2m1 codes per byte needs an even last dim, got shape "
            f"{tuple(codes.shape)}; pad the last dim to a multiple of 2"
        )
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (..., n / 2) -> codes (..., n), the inverse of `pack_e2m1`."""
    pairs = torch.stack([packed & 0xF, packed >> 4], dim=-1)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def as_float4(packed: torch.Tensor) -> torch.Tensor:
    """The packed bytes viewed as `torch.float4_e2m1fn_x2` (same layout; no copy)."""
    return packed.view(FLOAT4)
