"""The float8 payload codec (`fsdp_float8.core.payload`): one format and one e8m0 convention for
every "float8 bytes + scales in one uint8 buffer" (rowwise and block all-gather, float8
reduce-scatter), and typed all-gather metadata."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fsdp_float8 import Float8LinearConfig, Float8Tensor
from fsdp_float8.core.payload import E8M0, PayloadLayout, e8m0_from_scale, scale_from_e8m0
from fsdp_float8.core.scaling import Blockwise, DynamicScaling
from fsdp_float8.formats.block import BlockGather
from fsdp_float8.formats.rowwise import RowwiseGather
from fsdp_float8.formats.tensorwise import TensorwiseGather
from fsdp_float8.fsdp.reduce_scatter import dequantize_blocks, quantize_blocks
from fsdp_float8.nn.linear import Float8Linear

E4M3 = torch.float8_e4m3fn


def test_one_e8m0_convention_in_all_gather_and_reduce_scatter() -> None:
    # a block with amax 3.5 in e4m3 has the power-of-two scale 448 / 3.5 = 2^7: its
    # dequantization factor 2^-7 is e8m0 byte 127 - 7 = 120 on every wire
    hp = torch.zeros(32, 32)
    hp[0, 0] = 3.5
    mx = DynamicScaling(granularity=Blockwise((32, 32), E8M0), power_of_2=True)
    scale = mx.scale(hp, -1, E4M3)
    assert scale.item() == 128.0
    data = mx.granularity.cast(hp, scale, -1, E4M3)
    gathered, meta = BlockGather.pack(data, scale, E8M0, False, (32, 32))
    assert gathered[0, 32].item() == 120
    sent = quantize_blocks(hp[:1], block_size=32, float8_dtype=E4M3, scale_dtype=E8M0)
    assert sent[0, 32].item() == 120
    assert e8m0_from_scale(scale).view(torch.uint8).item() == 120


def test_e8m0_round_trips_power_of_two_scales() -> None:
    scale = 2.0 ** torch.arange(-100, 101, dtype=torch.float32)
    assert torch.equal(scale_from_e8m0(e8m0_from_scale(scale)), scale)


@pytest.mark.parametrize("scale_dtype", [torch.float32, E8M0], ids=["fp32", "e8m0"])
@pytest.mark.parametrize("k", [32, 30], ids=["aligned", "unaligned"])
def test_layout_round_trips_data_and_scales_of_each_group(scale_dtype, k) -> None:
    data = torch.randn(6, k).to(E4M3)
    scale = 2.0 ** torch.randint(-8, 8, (3, 5)).float()  # 3 groups of 2 rows, 5 scales each
    layout = PayloadLayout.fitting(E4M3, scale_dtype, k, 2, 5)
    payload = torch.cat([layout.encode(d, s) for d, s in zip(data.chunk(3), scale)])
    assert payload.dtype == torch.uint8 and payload.shape == (6, layout.row_bytes)
    assert torch.equal(layout.data(payload).view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(layout.scales(payload, 3, 5), scale)


def test_layout_refuses_scales_that_do_not_fit() -> None:
    layout = PayloadLayout(E4M3, torch.float32, 8, 4)
    with pytest.raises(ValueError, match="do not fit 2 rows"):
        layout.encode(torch.zeros(2, 8, dtype=E4M3), torch.ones(3))


def test_reduce_scatter_rows_decode_with_the_codec() -> None:
    hp = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    kw = dict(block_size=32, float8_dtype=E4M3, scale_dtype=torch.float32)
    packed = quantize_blocks(hp, **kw)
    layout = PayloadLayout(E4M3, torch.float32, 128, 16)
    assert packed.shape == (3, layout.row_bytes)
    scales = layout.scales(packed, 3, 4)
    blocks = layout.data(packed).float().view(3, 4, 32) / scales[..., None]
    assert torch.equal(blocks.view(3, 128)[:, :100], dequantize_blocks(packed, 100, **kw))


class _Mesh:
    def size(self) -> int:
        return 1


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8"])
def test_all_gather_metadata_is_a_typed_record(recipe) -> None:
    config = Float8LinearConfig.from_recipe_name(recipe, enable_fsdp_float8_all_gather=True)
    layer = Float8Linear(64, 64, config=config)
    w = layer.weight
    inputs, meta = w.fsdp_pre_all_gather(_Mesh(), w.shape, w.stride(), layer, None)
    kinds = {"tensorwise": TensorwiseGather, "rowwise": RowwiseGather, "mxfp8": BlockGather}
    assert type(meta) is kinds[recipe] and dataclasses.is_dataclass(meta)
    assert len(inputs) == 1 and inputs[0].dtype == torch.uint8
    weight, _ = w.fsdp_post_all_gather(inputs, meta, torch.float32)
    assert isinstance(weight, Float8Tensor) and weight.shape == w.shape
    # the gathered float8 weight dequantizes to the weight within e4m3 precision
    torch.testing.assert_close(weight.dequantize(), w._tensor, rtol=0.07, atol=1e-6)


def _tensorwise_meta(data: torch.Tensor, scale: torch.Tensor):
    return TensorwiseGather(scale, data.dtype, False)


@pytest.mark.parametrize("fmt", ["tensorwise", "rowwise", "block"])
def test_a_refill_checks_the_weight_still_views_the_gathered_buffer(fmt) -> None:
    """A refill updates the unsharded weight FSDP2 built from the gathered buffers; one whose
    data no longer views them (replaced after the first all-gather) would keep stale values
    silently, so it is refused. The refill of the real weight updates its scale in place."""
    hp = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    if fmt == "block":
        mx = DynamicScaling(granularity=Blockwise((32, 32), E8M0), power_of_2=True)
        scale = mx.scale(hp, -1, E4M3)
        data = mx.granularity.cast(hp, scale, -1, E4M3)
        payload, meta = BlockGather.pack(data, scale, E8M0, False, (32, 32))
        outputs: tuple = (payload,)
    elif fmt == "rowwise":
        scale = 448.0 / hp.abs().amax(dim=1, keepdim=True)
        data = (hp * scale).to(E4M3)
        outputs, meta = RowwiseGather.pack(data, scale, False, (), shards=2)
    else:
        scale = 448.0 / hp.abs().amax()
        data = (hp * scale).to(E4M3)
        outputs, meta = (data.view(torch.uint8),), _tensorwise_meta(data, scale)
    weight, inner = meta.build(outputs, torch.float32)
    scale_tensor, before = weight._scale, weight.dequantize()
    meta.refill(weight, outputs)  # the same buffers: accepted, the scale kept in place
    assert weight._scale is scale_tensor and torch.equal(weight.dequantize(), before)
    stale = Float8Tensor(weight._data.clone(), weight._scale, torch.float32, block=weight._block)
    with pytest.raises(RuntimeError, match="does not view the gathered buffer"):
        meta.refill(stale, outputs)
