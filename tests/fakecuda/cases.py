"""Shared helpers of the fake-CUDA cases: one layer's three GEMMs under fake CUDA."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_float8 import Float8Linear, Float8LinearConfig
from tests.fakecuda.fake_cuda import backward

FLOAT8_GEMMS = ("_scaled_mm", "_scaled_mm_v2")
# parameter regimes: (parameter dtype, autocast to bf16)
PARAMS = {
    "bf16": (torch.bfloat16, False),
    "fp32_autocast": (torch.float32, True),
    "fp32": (torch.float32, False),
}


def run_linear(
    config: Float8LinearConfig,
    dims: tuple[int, int],
    tokens: tuple[int, ...],
    params: str,
    *,
    bias: bool = True,
) -> None:
    """Forward and backward of one Float8Linear on fake cuda; checks what the three GEMMs
    give back (shapes and dtypes as nn.Linear's)."""
    dtype, autocast = PARAMS[params]
    in_f, out_f = dims
    with torch.device("cuda"):
        layer = Float8Linear.from_float(nn.Linear(in_f, out_f, bias=bias, dtype=dtype), config)
        x = torch.randn(*tokens, in_f, dtype=dtype, requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = layer(x)
    want = torch.bfloat16 if autocast else dtype
    assert out.shape == (*tokens, out_f) and out.dtype == want, (out.shape, out.dtype)
    backward(out.float().square().sum())
    assert x.grad.shape == x.shape and x.grad.dtype == dtype
    assert layer.weight.grad.shape == (out_f, in_f) and layer.weight.grad.dtype == dtype
    if bias:
        assert layer.bias.grad.shape == (out_f,)


def float8_gemm_calls(calls: dict[str, int]) -> int:
    return sum(calls.get(name, 0) for name in FLOAT8_GEMMS)
