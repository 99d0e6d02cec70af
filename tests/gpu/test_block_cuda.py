"""CUDA block-scaled GEMMs (marked `gpu`; skipped without CUDA, and per recipe where the
device lacks the kernel: SM90 for 'blockwise', SM100 for 'mxfp8'): the real GEMM against its
float32 emulation, all three GEMMs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_float8 import Float8Linear, Float8LinearConfig, sqnr_db
from fsdp_float8.core.blocks_cuda import cuda_block_gemm_problem
from fsdp_float8.core.numerics import SQNR_DB

pytestmark = pytest.mark.gpu
_BLOCKS = {"blockwise": ((1, 128), (128, 128), torch.float32)}
_BLOCKS["mxfp8"] = ((1, 32), (32, 32), torch.float8_e8m0fnu)


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_real_block_gemm_matches_emulation(recipe):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    a_block, b_block, scale_dtype = _BLOCKS[recipe]
    problem = cuda_block_gemm_problem("cuda", a_block, b_block, scale_dtype, 256, 512, 256)
    if problem is not None:
        pytest.skip(problem)
    torch.manual_seed(0)
    base = nn.Linear(256, 512, bias=False, device="cuda", dtype=torch.bfloat16)
    real = Float8Linear.from_float(base, Float8LinearConfig.from_recipe_name(recipe))
    emul = Float8Linear.from_float(base, Float8LinearConfig.from_recipe_name(recipe, emulate=True))
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    outs, grads = [], []
    for mod in (real, emul):
        xi = x.clone().requires_grad_()
        out = mod(xi)
        out.backward(torch.ones_like(out))
        outs.append(out.detach())
        grads.append((xi.grad, base.weight.grad.clone()))
        base.weight.grad = None
    assert sqnr_db(outs[1], outs[0]) >= SQNR_DB["real_vs_emulated"] - 10
    for g_real, g_emul in zip(*grads):
        assert sqnr_db(g_emul, g_real) >= SQNR_DB["real_vs_emulated"] - 10
