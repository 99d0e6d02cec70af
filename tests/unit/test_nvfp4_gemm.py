"""The NVFP4 GEMM's dispatch and its CUDA operands, on CPU: what `nvfp4_mm` hands
`F.scaled_mm` (padded codes, swizzled 1x16 factors, the tensor factor) holds exactly the
quantized tensor; a weight's operands built once (`gemm_operand_parts`) are those bytes,
its grad_input operand from its transposed tiles; CPU always emulates; a CUDA device below
SM100 is refused with the remedy unless `emulate=True`. (The fake-CUDA lane checks the call
against torch's meta kernel.)"""

from __future__ import annotations

import pytest
import torch

from fsdp_float8 import NVFP4Config
from fsdp_float8.core import e2m1, nvfp4, nvfp4_gemm
from fsdp_float8.core.config_fields import Float8ConfigError


def _amax(t: torch.Tensor) -> torch.Tensor:
    return t.abs().amax()


def _unswizzle(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """(rows, cols) factors back from cuBLAS's blocked layout: entry (i, j) sits in 128x4
    tile (i // 128, j // 4), at row (i % 32) and column 4 * ((i % 128) // 32) + j % 4 of its
    32x16 image."""
    raw, tiles_per_row = flat.view(torch.uint8), -(-cols // 4)
    out = torch.empty(rows, cols, dtype=torch.uint8)
    for i in range(rows):
        for j in range(cols):
            tile = (i // 128) * tiles_per_row + j // 4
            out[i, j] = raw[tile * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4]
    return out.view(nvfp4.E4M3)


@pytest.mark.parametrize(
    "rows,k,block",
    [(7, 48, nvfp4.ACTIVATION_BLOCK), (130, 64, nvfp4.ACTIVATION_BLOCK), (80, 48, (16, 16))],
    ids=["7x48_1x16", "130x64_1x16", "80x48_16x16"],
)
def test_cuda_operand_holds_the_quantized_tensor(rows, k, block):
    torch.manual_seed(0)
    x = torch.randn(rows, k) * torch.logspace(-3, 3, k)  # blocks of very different amaxes
    q = nvfp4.quantize(x, _amax(x), block)
    data, (factors, tensor_factor) = nvfp4_gemm._cuda_operand(q)
    k_pad = -(-k // 32) * 32  # rows of whole 16-byte words
    assert data.dtype == torch.float4_e2m1fn_x2 and data.shape == (rows, k_pad // 2)
    assert data.is_contiguous() and factors.is_contiguous() and factors.dtype == nvfp4.E4M3
    assert factors.numel() == (-(-rows // 128) * 128) * (-(-k // 64) * 4)  # the meta's count
    codes = e2m1.unpack_e2m1(data.view(torch.uint8))
    assert torch.equal(codes[:, k:], torch.zeros(rows, k_pad - k, dtype=torch.uint8))
    per_block = _unswizzle(factors, rows, k // 16).float()
    values = e2m1.e2m1_values(codes[:, :k])
    rebuilt = (values * per_block.repeat_interleave(16, dim=1)) * tensor_factor
    assert tensor_factor.dtype == torch.float32 and tensor_factor.numel() == 1
    assert torch.equal(rebuilt, nvfp4.dequantize(q))  # bit for bit, as cuBLAS would read it


def test_transposed_weight_operand_repeats_each_tile_over_its_rows():
    w = torch.randn(32, 48)
    qt = nvfp4.transposed(nvfp4.quantize(w, _amax(w), nvfp4.WEIGHT_BLOCK))  # (48, 32)
    _, (factors, _) = nvfp4_gemm._cuda_operand(qt)
    want = qt.block_inv_scale.float().repeat_interleave(16, dim=0)
    assert torch.equal(_unswizzle(factors, 48, 2).float(), want)


@pytest.mark.parametrize("rows,k", [(80, 48), (32, 64)], ids=["80x48_padded", "32x64"])
@pytest.mark.parametrize("transpose", [False, True], ids=["output", "grad_input"])
def test_built_weight_operand_is_the_per_gemm_operand(rows, k, transpose):
    # the operand a weight's GEMM takes as it is: the bytes the GEMM would otherwise make
    # from the record (transposed for grad_input), and rebuilt into the same buffers
    torch.manual_seed(0)
    w = torch.randn(rows, k) * torch.logspace(-3, 3, k)
    q = nvfp4.quantize(w, _amax(w), nvfp4.WEIGHT_BLOCK)
    (codes, factors), buffers = nvfp4_gemm.gemm_operand_parts(q, transpose=transpose)
    want_codes, (want_factors, _) = nvfp4_gemm._cuda_operand(
        nvfp4.transposed(q) if transpose else q
    )
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(factors.view(torch.uint8), want_factors.view(torch.uint8))
    operand = nvfp4_gemm.gemm_operand(q, (codes, factors), transpose=transpose)
    assert operand.shape == ((k, rows) if transpose else (rows, k))
    assert operand.tensor_factor is not None and operand.tensor_factor.dim() == 0
    # codes needing neither padding nor transposition are the record's own bytes
    as_is = not transpose and k % 32 == 0
    assert (codes.view(torch.uint8).data_ptr() == q.packed.data_ptr()) == as_is
    assert len(buffers) == (1 if as_is else 2)
    w2 = torch.randn(rows, k)
    q2 = nvfp4.quantize(w2, _amax(w2), nvfp4.WEIGHT_BLOCK)
    (codes2, factors2), new = nvfp4_gemm.gemm_operand_parts(
        q2, transpose=transpose, out=(codes, factors)
    )
    assert new == () and factors2.data_ptr() == factors.data_ptr()
    assert as_is or codes2.view(torch.uint8).data_ptr() == codes.view(torch.uint8).data_ptr()
    want_codes, (want_factors, _) = nvfp4_gemm._cuda_operand(
        nvfp4.transposed(q2) if transpose else q2
    )
    assert torch.equal(codes2.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(factors2.view(torch.uint8), want_factors.view(torch.uint8))


def test_prepared_mm_refuses_another_k_and_the_cpu():
    a, w = torch.randn(4, 32), torch.randn(16, 48)
    qa, qw = nvfp4.quantize(a, _amax(a)), nvfp4.quantize(w, _amax(w), nvfp4.WEIGHT_BLOCK)
    operand = nvfp4_gemm.gemm_operand(qw, nvfp4_gemm.gemm_operand_parts(qw)[0])
    with pytest.raises(ValueError, match="same K"):
        nvfp4_gemm.prepared_mm(qa, operand)
    qw32 = nvfp4.quantize(w[:, :32], _amax(w), nvfp4.WEIGHT_BLOCK)
    with pytest.raises(ValueError, match="use nvfp4_mm"):
        nvfp4_gemm.prepared_mm(
            qa, nvfp4_gemm.gemm_operand(qw32, nvfp4_gemm.gemm_operand_parts(qw32)[0])
        )


def test_cpu_always_emulates():
    a, b = torch.randn(5, 32), torch.randn(16, 32)
    qa, qb = nvfp4.quantize(a, _amax(a)), nvfp4.quantize(b, _amax(b), nvfp4.WEIGHT_BLOCK)
    want = nvfp4_gemm.emulated_mm(qa, qb, torch.bfloat16)
    for emulate in (False, True):
        assert torch.equal(nvfp4_gemm.nvfp4_mm(qa, qb, torch.bfloat16, emulate=emulate), want)
    nvfp4_gemm.check_nvfp4_gemm_device(torch.device("cpu"), emulate=False)  # nothing to refuse


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0), (12, 0)])
def test_cuda_below_sm100_is_refused_with_the_remedy(capability, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda = torch.device("cuda", 0)
    nvfp4_gemm.check_nvfp4_gemm_device(cuda, emulate=True)  # emulated GEMMs run anywhere
    if capability >= (10, 0):
        assert nvfp4_gemm.nvfp4_gemm_problem(cuda) is None
        nvfp4_gemm.check_nvfp4_gemm_device(cuda, emulate=False)
        return
    sm = f"SM{capability[0]}{capability[1]}"
    with pytest.raises(ValueError, match=rf"SM100.*{sm}.*NVFP4Config\(emulate=True\)"):
        nvfp4_gemm.check_nvfp4_gemm_device(cuda, emulate=False)


def test_nvfp4_mm_refuses_operands_of_different_k():
    a, b = torch.randn(4, 32), torch.randn(16, 48)
    with pytest.raises(ValueError, match="same K"):
        nvfp4_gemm.nvfp4_mm(nvfp4.quantize(a, _amax(a)), nvfp4.quantize(b, _amax(b)))


def test_emulate_must_be_a_bool():
    with pytest.raises(Float8ConfigError, match="emulate must be a bool"):
        NVFP4Config(emulate=1)  # type: ignore[arg-type]
    assert NVFP4Config(emulate=True).emulate is True
