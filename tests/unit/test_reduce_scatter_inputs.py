"""Block sizes of the float8 reduce-scatter are checked up front, never inside a collective.

The packed rows carry float32 scales after each chunk's float8 bytes, so a block size that is
not a multiple of 4 misaligns them; each chunk is padded to whole blocks, so a huge block
allocates and sends mostly padding (a block of 10^9 elements is ~4 GB of float32 per chunk).
`Float8ReduceScatter`, `enable_float8_reduce_scatter` and the public codec helpers refuse
both with a ValueError naming the value, the accepted range and a remedy.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdp_float8.core.numerics import sqnr_db
from fsdp_float8.fsdp.reduce_scatter import (
    MAX_BLOCK_SIZE,
    Float8ReduceScatter,
    dequantize_blocks,
    enable_float8_reduce_scatter,
    packed_row_bytes,
    quantize_blocks,
)

E4M3, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
BAD = [0, -4, 1, 6, 7, 10, MAX_BLOCK_SIZE + 4, 10**9, 128.0, True, "128"]
# the message names the value, the rule and a remedy
REFUSAL = r"block_size=.*multiple of 4.*4 to 4096.*block_size=128"
# one block-scaled e4m3 cast of randn (the round-trip bar of tests/distributed)
ROUNDTRIP_SQNR_DB = 30.0


def _calls(block_size):
    kw = dict(block_size=block_size, float8_dtype=E4M3)
    yield lambda: Float8ReduceScatter(block_size=block_size)
    yield lambda: enable_float8_reduce_scatter(nn.Linear(4, 4), block_size=block_size)
    yield lambda: quantize_blocks(torch.randn(2, 10), **kw)
    yield lambda: dequantize_blocks(torch.zeros(1, 64, dtype=torch.uint8), 10, **kw)
    yield lambda: packed_row_bytes(10, block_size, torch.float32)


@pytest.mark.parametrize("block_size", BAD, ids=repr)
def test_bad_block_size_is_refused_everywhere(block_size) -> None:
    for call in _calls(block_size):
        with pytest.raises((ValueError, TypeError), match=REFUSAL) as info:
            call()
        assert repr(block_size) in str(info.value)


@pytest.mark.parametrize("scale_dtype", [torch.float32, E8M0], ids=["fp32", "e8m0"])
@pytest.mark.parametrize("block_size", [4, 12, 128, MAX_BLOCK_SIZE])
def test_accepted_block_sizes_round_trip_any_chunk(block_size: int, scale_dtype) -> None:
    """Chunks of any length (not a multiple of 4 nor of the block) and one row at a time,
    as the reduce-scatter dequantizes them."""
    kw = dict(block_size=block_size, float8_dtype=E4M3, scale_dtype=scale_dtype)
    Float8ReduceScatter(**kw)
    torch.manual_seed(0)
    for n in (1, 37, 1001):
        x = torch.randn(3, n)
        packed = quantize_blocks(x, **kw)
        assert packed.shape[1] == packed_row_bytes(n, block_size, scale_dtype)
        y = torch.cat([dequantize_blocks(packed[r : r + 1], n, **kw) for r in range(3)])
        assert sqnr_db(x, y) >= ROUNDTRIP_SQNR_DB


# Run under an address-space cap of 1 GiB above the interpreter's size: were the block not
# refused, its ~4 GB padded chunk would fail to allocate instead of swapping the machine.
_CAPPED = textwrap.dedent(
    """
    import resource, time
    import torch
    from fsdp_float8.fsdp.reduce_scatter import Float8ReduceScatter, quantize_blocks
    size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + 2**30, resource.RLIM_INFINITY))
    start = time.monotonic()
    for call in (lambda: quantize_blocks(torch.randn(2, 1000), block_size=10**9,
                                         float8_dtype=torch.float8_e4m3fn),
                 lambda: Float8ReduceScatter(block_size=10**9)):
        try:
            call()
        except ValueError as e:
            assert "block_size=1000000000" in str(e), e
        else:
            raise SystemExit("block_size=10**9 was accepted")
    print(f"refused in {time.monotonic() - start:.3f} s")
    """
)


def test_huge_block_is_refused_before_any_allocation() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _CAPPED],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert float(proc.stdout.split()[-2]) < 1.0, proc.stdout
