"""The CUDA NVFP4 GEMM against its float32 emulation (marked `gpu`; skipped without CUDA,
and without an SM100+ device for the FP4 GEMM itself).

Both compute sum_k a_k * b_k * (block factors) * (tensor factors) from the same codes and
factors. Each product of two e2m1 values and two e4m3 factors has at most 12 significant
bits, so it is exact in float32; what differs is the order of the float32 additions and
where the tensor factors are applied (per element in the emulation, once at the end in the
GEMM). So |gemm - emulation| <= (K + 4) * 2^-23 * (|A| @ |B|^T), A and B dequantized: the
bound below, derived rather than measured.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_float8.core import nvfp4, nvfp4_gemm

pytestmark = pytest.mark.gpu


def _blackwell() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    problem = nvfp4_gemm.nvfp4_gemm_problem(device)
    if problem is not None:
        pytest.skip(problem)
    return device


@pytest.mark.parametrize("m,k,n", [(128, 256, 512), (10, 48, 80), (7, 1024, 16)])
def test_fp4_gemm_matches_the_emulation_within_float32_summation(m, k, n):
    device = _blackwell()
    torch.manual_seed(0)
    a = torch.randn(m, k, device=device) * torch.logspace(-2, 2, k, device=device)
    b = torch.randn(n, k, device=device)
    qa = nvfp4.quantize(a, a.abs().amax(), nvfp4.ACTIVATION_BLOCK)
    qb = nvfp4.quantize(b, b.abs().amax(), nvfp4.WEIGHT_BLOCK)
    real = nvfp4_gemm.nvfp4_mm(qa, qb, torch.float32)
    emul = nvfp4_gemm.emulated_mm(qa, qb, torch.float32)
    bound = (k + 4) * 2.0**-23 * (nvfp4.dequantize(qa).abs() @ nvfp4.dequantize(qb).abs().t())
    assert ((real - emul).abs() <= bound).all(), ((real - emul).abs() / bound).max()
    bf16 = nvfp4_gemm.nvfp4_mm(qa, qb, torch.bfloat16)  # rounded from the same float32 sums
    assert ((bf16.float() - real).abs() <= 2.0**-8 * real.abs() + bound).all()
