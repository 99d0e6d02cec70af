"""A rowwise float8-gathered weight brings its row scales' inverses with the all-gather.

Each shard makes `1 / scale` of its rows when it packs them and sends them beside the
scales (K + 8 bytes a row), so the unsharded weight's `Float8Tensor._inverse` is what the
GEMMs multiply by: the output GEMM takes it as it is (no reciprocal of the weight's scales in
the layer, a graph input when compiled), and the non-power-of-two grad_input re-cast
dequantizes with it. Checked here with the hooks' pack and build on simulated shards (the
all-gather is the concatenation of the shards' inputs), at shard sizes 1 and 2.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_float8 import Float8Linear, Float8LinearConfig, Float8Tensor
from fsdp_float8.core.scaling import scale_from_amax
from fsdp_float8.formats.rowwise import RowwiseGather

N, K, M = 64, 48, 32
E4M3 = torch.float8_e4m3fn


def _row_cast(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = scale_from_amax(w.abs().amax(dim=1, keepdim=True).float(), E4M3, power_of_2=False)
    return (w.float() * scale).to(E4M3), scale


def _gathered(w: torch.Tensor, shards: int) -> tuple[Float8Tensor, list]:
    """The unsharded weight the rowwise hooks build from `shards` dim-0 shards of `w`."""
    packs = [
        RowwiseGather.pack(*_row_cast(part), False, (), shards=shards) for part in w.chunk(shards)
    ]
    outputs = tuple(torch.cat(parts) for parts in zip(*[inputs for inputs, _ in packs]))
    weight, _ = packs[0][1].build(outputs, torch.bfloat16)
    return weight, [outputs, packs]


@pytest.mark.parametrize("shards", [1, 2])
def test_gathered_rows_carry_the_inverse_of_their_scales(shards):
    torch.manual_seed(0)
    w = torch.randn(N, K) * torch.logspace(-3, 3, N).unsqueeze(1)
    weight, (outputs, packs) = _gathered(w, shards)
    inverse = weight._inverse
    assert inverse is not None and inverse.shape == (N, 1) and inverse.is_contiguous()
    assert torch.equal(inverse, weight._scale.reciprocal())
    assert torch.equal(weight._scale, _row_cast(w)[1])
    # flattened with data and scale: a compiled graph takes it as an input
    assert weight.__tensor_flatten__()[0] == ["_data", "_scale", "_inverse"]
    # the next unshard refills it in place with the new values
    w2 = w.flip(0)
    refilled, _ = _gathered(w2, shards)
    new_packs = [
        RowwiseGather.pack(*_row_cast(part), False, (), shards=shards) for part in w2.chunk(shards)
    ]
    new_outputs = tuple(torch.cat(p) for p in zip(*[inputs for inputs, _ in new_packs]))
    for out, new in zip(outputs, new_outputs, strict=True):
        out.copy_(new)
    new_packs[0][1].refill(weight, outputs)
    assert torch.equal(weight._inverse, refilled._inverse)
    assert torch.equal(weight._scale, refilled._scale)


class _Reciprocals(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.reciprocal.default:
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


def test_output_gemm_takes_the_gathered_inverse():
    """The layer's forward makes no reciprocal of the gathered weight's N row scales (only
    of the input's M row scales), and gives the bytes it gives when it makes them itself."""
    torch.manual_seed(0)
    config = Float8LinearConfig.from_recipe_name("rowwise", enable_fsdp_float8_all_gather=True)
    layer = Float8Linear(K, N, bias=False, config=config).to(torch.bfloat16)
    weight, _ = _gathered(layer.weight._tensor.detach(), 2)
    x = torch.randn(M, K, dtype=torch.bfloat16)
    with _Reciprocals() as seen:
        out = torch.func.functional_call(layer, {"weight": weight}, (x,))
    assert (N, 1) not in seen.shapes and (1, N) not in seen.shapes, seen.shapes
    # the same weight without its inverse: the layer inverts the N scales itself
    bare = Float8Tensor(weight._data, weight._scale, torch.bfloat16)
    with _Reciprocals() as seen_bare:
        expected = torch.func.functional_call(layer, {"weight": bare}, (x,))
    assert (1, N) in seen_bare.shapes, seen_bare.shapes
    assert torch.equal(out, expected)
