"""Seeded randomness for low-precision casts: counter-based uniform draws and the random
Hadamard transform.

`hashed_uniform` gives one draw per element from a hash of (the element's index, a salt
tensor): plain integer tensor ops, no generator state, so the same salt draws alike on every
device, in a rerun, an activation-checkpoint recompute and a compiled graph. The random
Hadamard transform R = D @ H / 4 (D a seeded +-1 diagonal, H the 16x16 Sylvester matrix) is
orthogonal: applied to runs of 16 elements along the contraction dim of both GEMM operands
it leaves the product unchanged while spreading outliers before a blockwise cast.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F

RHT_SIZE = 16


_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) on int64 holding 32-bit values;
    every product stays below 2^59, so nothing overflows."""
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def hashed_uniform(shape, salt: torch.Tensor) -> torch.Tensor:
    """Counter-based draws: multiples of 2^-24 in [0, 1), one per element of `shape`, a hash
    of (the element's index, `salt`: a 0-d int64 tensor). The same salt gives the same
    draws on every device and under torch.compile (plain tensor ops, no generator state)."""
    n = math.prod(shape)
    index = torch.arange(n, dtype=torch.int64, device=salt.device)
    key = _mix32(salt.reshape(()).to(torch.int64) & _MASK32)
    bits = _mix32(_mix32(index ^ key) ^ (key * 0x9E37 & _MASK32))
    return ((bits >> 8).to(torch.float32) * 2.0**-24).reshape(shape)


def random_hadamard(generator: torch.Generator) -> torch.Tensor:
    """R = D @ H / 4 (16x16 float32, orthogonal): D the diagonal of 16 random signs drawn
    from `generator`, H the Sylvester Hadamard matrix."""
    h = torch.ones(1, 1, device="cpu")  # on the CPU whatever the default device
    step = torch.tensor([[1.0, 1.0], [1.0, -1.0]], device="cpu")
    while h.shape[0] < RHT_SIZE:
        h = torch.kron(step, h)
    bits = torch.randint(0, 2, (RHT_SIZE,), generator=generator, device=generator.device)
    signs = (1 - 2 * bits).to(torch.float32).cpu()
    return signs[:, None] * h / math.sqrt(RHT_SIZE)


def rht(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """Each run of 16 elements along the last dim times `matrix` (`random_hadamard`)."""
    if matrix.shape != (RHT_SIZE, RHT_SIZE) or x.shape[-1] % RHT_SIZE:
        raise ValueError(
            f"the Hadamard transform takes a {RHT_SIZE}x{RHT_SIZE} matrix and a last dim "
            f"divisible by {RHT_SIZE}, got {tuple(matrix.shape)} and {tuple(x.shape)}; "
            "pad the contraction dim to a multiple of 16"
        )
    runs = x.reshape(*x.shape[:-1], x.shape[-1] // RHT_SIZE, RHT_SIZE)
    return (runs @ matrix.to(runs.device, runs.dtype)).reshape(x.shape)


def inverse_rht(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """The inverse of `rht`: times the transpose (the matrix is orthogonal)."""
    return rht(x, matrix.t())


def layer_seed(*parts: object) -> int:
    """A stable 32-bit seed of `parts` (a config seed, a layer's name, a purpose): the same
    in every process and run (crc32 of their repr, not Python's salted hash)."""
    return zlib.crc32(repr(parts).encode())


def rounding_draws(t: torch.Tensor, seed: int, gemm: int) -> torch.Tensor:
    """Uniform draws for stochastically rounding `t`: a hash of the layer (`seed`), the GEMM
    and t's bits (the sum of its float32 bit patterns), per element."""
    bits = t.detach().float().contiguous().view(torch.int32).to(torch.int64).sum()
    salt = (bits + seed * 31 + gemm) & _MASK32
    return hashed_uniform(t.shape, salt)


def pad_tokens(t: torch.Tensor) -> torch.Tensor:
    """(rows, tokens) with zero tokens appended up to a multiple of the Hadamard size (they
    add nothing), row-major. The input is made row-major first: a pad of 0 keeps a
    transposed input's strides at run time, where a dynamic-shape trace takes the padded
    result as row-major."""
    return F.pad(t.contiguous(), (0, -t.shape[1] % RHT_SIZE))
