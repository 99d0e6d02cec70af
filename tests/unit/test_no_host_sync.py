"""Hot paths make no host-to-device copies: static scales are one cached device tensor (not a
`torch.tensor(python_float)` per cast and per all-gather), and the float8 reduce-scatter
picks the chunks for the other ranks with slices (indexing with a Python list copies an
index tensor from the host)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_float8 import CastConfig, Float8Linear, Float8LinearConfig, Float8ReduceScatter
from fsdp_float8.fsdp.reduce_scatter import dequantize_blocks
from tests.unit.float8_helpers import OpLog

aten = torch.ops.aten
STATIC = CastConfig(scaling_type="static", static_scale=64.0)
CONFIG = Float8LinearConfig(
    cast_config_input=STATIC,
    cast_config_weight=STATIC,
    cast_config_grad_output=STATIC,
    enable_fsdp_float8_all_gather=True,
)


def test_static_scales_are_one_cached_tensor():
    layer = Float8Linear(32, 32, config=CONFIG)
    weight = layer.weight
    first = weight.float8_scale(None)
    assert weight.float8_scale(None) is first  # the all-gather's weight scale
    strategy = layer.plan.strategies[next(iter(layer.plan.strategies))]
    x = torch.randn(4, 32)
    assert strategy.scale(x, -1, torch.float8_e4m3fn) is strategy.scale(x, -1, torch.float8_e4m3fn)
    assert float(first) == 64.0
    with OpLog() as mode:
        layer(x).sum().backward()
    assert aten.lift_fresh.default not in mode.ops  # no torch.tensor(python value) per cast


def test_reduce_scatter_selects_chunks_without_an_index_tensor(monkeypatch):
    def fake_all_to_all(out, inp, out_splits, in_splits, group=None, async_op=False):
        out.copy_(inp)  # a stand-in: what rank 1 would send looks like what we send

    monkeypatch.setattr(dist, "all_to_all_single", fake_all_to_all)
    comm = Float8ReduceScatter(block_size=8)
    chunks = torch.randn(3, 20)
    with OpLog() as mode:
        received = comm._exchange(chunks, None, rank=1)
    assert aten.index.Tensor not in mode.ops
    got = dequantize_blocks(received, 20, block_size=8, float8_dtype=torch.float8_e4m3fn)
    # the rows sent are chunks 0 and 2 (not this rank's 1), to e4m3 block precision
    torch.testing.assert_close(got, chunks[[0, 2]], rtol=0.07, atol=0.0)
