"""The rowwise grad_input operand of a float8-gathered weight costs no more than a bf16 one.

A rowwise float8 all-gather delivers the weight's rows cast along K; grad_input contracts
over N, so backward re-casts them. Counted with a dispatch mode over one Float8Linear
backward (single process, the gathered weight built by the wrapper's all-gather hooks at
shard size 1): bytes of newly allocated high-precision tensors of the weight's size (not
views, not in-place writes, not GEMM outputs). The float8-gathered weight must cost at most
what the same layer with a bf16-gathered weight does (its abs in bf16, a float32 copy, the
scaled and the clamped float32: 14 bytes per element), and the grad_input must be equal.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_float8 import Float8Linear, Float8LinearConfig

N, K, M = 160, 96, 16  # distinct sizes: only the weight has N * K elements


class _OneShard:
    def size(self) -> int:
        return 1


class _WeightSizedBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        fresh = isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in inputs
        if fresh and "mm" not in func.overloadpacket.__name__ and out.numel() == N * K:
            if out.dtype.is_floating_point and out.dtype.itemsize > 1:
                self.bytes += out.numel() * out.dtype.itemsize
        return out


def _backward_bytes(float8_all_gather: bool) -> tuple[int, torch.Tensor]:
    torch.manual_seed(0)
    config = Float8LinearConfig.from_recipe_name(
        "rowwise", enable_fsdp_float8_all_gather=float8_all_gather
    )
    layer = Float8Linear(K, N, bias=False, config=config).to(torch.bfloat16)
    weight = layer.weight
    if float8_all_gather:
        inputs, meta = weight.fsdp_pre_all_gather(
            _OneShard(), weight.shape, weight.stride(), layer, None
        )
        weight, _ = weight.fsdp_post_all_gather(inputs, meta, torch.bfloat16)
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    out = torch.func.functional_call(layer, {"weight": weight}, (x,))
    with _WeightSizedBytes() as counter:
        out.sum().backward()
    assert x.grad is not None
    return counter.bytes, x.grad


def test_rowwise_grad_input_of_a_float8_gathered_weight_costs_at_most_bf16():
    float8_bytes, float8_grad = _backward_bytes(True)
    bf16_bytes, _ = _backward_bytes(False)
    assert bf16_bytes > 0
    assert float8_bytes <= bf16_bytes, (float8_bytes, bf16_bytes)
    assert torch.isfinite(float8_grad).all()
