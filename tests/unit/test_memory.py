"""Activation memory of Float8Linear: what autograd keeps for backward.

Where grad_weight takes the forward's input cast as it is (tensorwise: the same scale and
bytes), the layer keeps its input as float8 data plus a 0-d scale instead of the
high-precision input nn.Linear keeps: about half of bf16's bytes, with or without
`save_input_in_float8=True`. The weight (a parameter,
shared with the optimizer) is not counted. That the numerics are unchanged (backward casts
the same input with the same scale either way) is
tests/unit/test_linear.py::test_save_input_in_float8_same_grads_and_saves_float8.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_float8 import Float8Linear, Float8LinearConfig

SAVED_RATIO_MAX = 0.55


def _saved_activation_bytes(module: nn.Module, x: torch.Tensor) -> int:
    params = {p.data_ptr() for p in module.parameters()}
    total = 0

    def pack(t):
        nonlocal total
        if t.data_ptr() not in params:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x).float().sum().backward()
    return total


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_float8_saved_input_halves_activation_memory(dtype):
    torch.manual_seed(0)
    base = nn.Linear(256, 128, bias=False).to(dtype)
    x = torch.randn(4, 64, 256, dtype=dtype, requires_grad=True)
    hp_bytes = _saved_activation_bytes(base, x)  # nn.Linear keeps its input
    scales = 16  # a few 0-d float32 scales (the forward's, reused by backward)
    assert hp_bytes == x.numel() * x.element_size()
    for keep in (False, True):
        fp8 = Float8Linear.from_float(base, Float8LinearConfig(save_input_in_float8=keep))
        fp8_bytes = _saved_activation_bytes(fp8, x)
        assert fp8_bytes <= SAVED_RATIO_MAX * hp_bytes * (2 / x.element_size())
        assert x.numel() <= fp8_bytes <= x.numel() + scales  # float8 data + scales
