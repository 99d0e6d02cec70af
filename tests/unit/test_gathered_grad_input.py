"""The rowwise grad_input operand of a float8-gathered weight costs no more than a bf16 one.

A rowwise float8 all-gather delivers the weight's rows cast along K; grad_input contracts
over N, so backward re-casts them. Counted with a dispatch mode over one Float8Linear
backward (single process, the gathered weight built by the wrapper's all-gather hooks at
shard size 1): bytes of newly allocated high-precision tensors of the weight's size (not
views, not in-place writes, not GEMM outputs). The float8-gathered weight must cost at most
what the same layer with a bf16-gathered weight does (its abs in bf16, a float32 copy, the
scaled and the clamped float32: 14 bytes per element).

The re-cast is elementwise ops and an exact max, so its grad_input weight operand must be
bit-identical to dequantizing the rows into float32 and casting that with `cast_operand`,
for every grad_input cast a rowwise float8 all-gather admits (axiswise, tensorwise, either
float8 dtype, power-of-two scales or not, and blocks, which take the dequantize path).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_float8 import CastConfig, Float8Linear, Float8LinearConfig, Float8Tensor, Gemm, Operand
from fsdp_float8.core.cast_plan import CastPlan
from fsdp_float8.formats.weight_operands import weight_for
from fsdp_float8.nn.linear import cast_operand

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


def _gathered(layer: Float8Linear) -> Float8Tensor:
    """The weight as the rowwise float8 all-gather hooks deliver it (one shard)."""
    weight = layer.weight
    inputs, meta = weight.fsdp_pre_all_gather(
        _OneShard(), weight.shape, weight.stride(), layer, None
    )
    gathered, _ = weight.fsdp_post_all_gather(inputs, meta, torch.bfloat16)
    assert isinstance(gathered, Float8Tensor)
    return gathered


_GRAD_INPUT_CASTS = {
    "axiswise_e4m3": {"scaling_granularity": "axiswise"},
    "axiswise_e5m2": {"scaling_granularity": "axiswise", "target_dtype": torch.float8_e5m2},
    "tensorwise": {"scaling_granularity": "tensorwise"},
    "blocks_128x128": {"scaling_granularity": "blockwise", "block_shape": (128, 128)},
    "blocks_1x128": {"scaling_granularity": "blockwise", "block_shape": (1, 128)},
}


@pytest.mark.parametrize("power_of_2", [False, True])
@pytest.mark.parametrize("grad_input_cast", sorted(_GRAD_INPUT_CASTS))
def test_grad_input_weight_from_gathered_rows_is_dequantize_then_cast(
    grad_input_cast: str, power_of_2: bool
) -> None:
    config = Float8LinearConfig.from_recipe_name(
        "rowwise",
        enable_fsdp_float8_all_gather=True,
        round_scales_to_power_of_2=power_of_2,
        cast_config_weight_for_grad_input=CastConfig(**_GRAD_INPUT_CASTS[grad_input_cast]),
    )
    n, k = 384, 256  # multiples of the 128 blocks
    layer = Float8Linear(k, n, bias=False, config=config).to(torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():  # rows and columns spanning 2^-12..2^12, one zero row
        w = torch.randn(n, k) * torch.logspace(-12, 12, n, base=2).unsqueeze(1)
        w *= torch.logspace(4, -4, k, base=2)[torch.randperm(k)]
        w[7] = 0
        layer.weight.copy_(w)
    gathered = _gathered(layer)
    plan = CastPlan.from_config(config)
    got = weight_for(gathered, Gemm.GRAD_INPUT, plan, cast_operand, {})
    hp = gathered._data.to(torch.float32) * gathered._scale.reciprocal()
    want = cast_operand(hp, Operand.WEIGHT, Gemm.GRAD_INPUT, plan, {})
    assert got[1] is not None and want[1] is not None
    assert got[0].dtype == want[0].dtype and got[0].shape == want[0].shape
    if "blocks" not in grad_input_cast:  # column-major, as the GEMM takes its right operand
        assert got[0].t().is_contiguous(), got[0].stride()
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("power_of_2", [False, True])
def test_expert_grad_input_weight_from_gathered_rows_once_per_unshard(power_of_2: bool) -> None:
    """A rowwise-gathered 3-D expert weight (E, out, in): grad_input's operand is the same
    bytes and scales as dequantize-then-cast, column-major per expert (the grouped GEMM's
    right operand, no copy in the GEMM), and built once per unshard."""
    from fsdp_float8.experts.gemm import cast_expert_operand, expert_weight_for
    from fsdp_float8.experts.modules import Float8GroupedExperts
    from tests.models import GroupedExperts

    config = Float8LinearConfig.from_recipe_name(
        "rowwise", enable_fsdp_float8_all_gather=True, round_scales_to_power_of_2=power_of_2
    )
    torch.manual_seed(0)
    hp = GroupedExperts(64, 96, 4)
    with torch.no_grad():  # columns spanning 2^-8..2^8, one zero row
        hp.w1.copy_(torch.randn(hp.w1.shape) * torch.logspace(-8, 8, 64, base=2))
        hp.w1[1, 5] = 0
    experts = Float8GroupedExperts.from_experts(hp.to(torch.bfloat16), config)
    weight = experts.w1
    inputs, meta = weight.fsdp_pre_all_gather(
        _OneShard(), weight.shape, weight.stride(), experts, None
    )
    gathered, _ = weight.fsdp_post_all_gather(inputs, meta, torch.bfloat16)
    assert isinstance(gathered, Float8Tensor) and gathered.dim() == 3
    plan, offs = experts.plan, torch.tensor([8, 16, 16, 24], dtype=torch.int32)
    got = expert_weight_for(gathered, Gemm.GRAD_INPUT, plan, offs)
    hp_w = gathered._data.to(torch.float32) * gathered._scale.reciprocal()
    want = cast_expert_operand(hp_w, Operand.WEIGHT, Gemm.GRAD_INPUT, plan, offs)
    assert got[1] is not None and want[1] is not None
    assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
    assert got[0].mT.is_contiguous(), got[0].stride()
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])
    again = expert_weight_for(gathered, Gemm.GRAD_INPUT, plan, offs)
    assert again[0] is got[0] and gathered._operands is not None
    assert gathered._operands.builds == 1
