"""Fake CUDA: FSDP2 with float8 training on a fake process group (one process plays one
rank): every weight wrapper, world size 8, uneven shards, HSDP, activation checkpointing,
the float8 reduce-scatter, experts, and the refresh collective before each forward. One
forward and backward of the workload model per case; a case checks
the collectives FSDP2 issued and that every sharded parameter got its gradient (the model
of tests/models.py, tiny; dim 1024 for the block-scaled all-gather)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdp_float8 import CastConfig, Float8LinearConfig, convert_to_float8_training
from fsdp_float8.fsdp.reduce_scatter import enable_float8_reduce_scatter
from tests.fakecuda.fake_cuda import B200, H200, backward, fake_cuda
from tests.fakecuda.fake_fsdp import fake_world
from tests.models import Transformer, model_args

pytestmark = pytest.mark.fakecuda

_DELAYED = CastConfig(scaling_type="delayed")
# weight wrapper -> (config fields, device, parameter dtype under FSDP2)
WRAPPERS = {
    "dynamic_tensorwise": (Float8LinearConfig.tensorwise, H200),
    "dynamic_rowwise": (Float8LinearConfig.rowwise, H200),
    "rowwise_with_gw_hp": (Float8LinearConfig.rowwise_with_gw_hp, H200),
    "delayed": (
        lambda **kw: Float8LinearConfig(
            cast_config_input=_DELAYED,
            cast_config_weight=_DELAYED,
            cast_config_grad_output=_DELAYED,
            **kw,
        ),
        H200,
    ),
    "static_weight": (
        lambda **kw: Float8LinearConfig(
            cast_config_weight=CastConfig(scaling_type="static", static_scale=64.0), **kw
        ),
        H200,
    ),
    "block_blockwise": (Float8LinearConfig.blockwise, H200),
    "block_mxfp8": (Float8LinearConfig.mxfp8, B200),
}
# name -> (mesh shape, mesh dim names); world size 3: the 256/512-row weights shard unevenly
MESHES = {"ws8": ((8,), None), "uneven_ws3": ((3,), None), "hsdp_2x4": ((2, 4), ("rep", "shard"))}


def _model(moe: bool = False, blocks: bool = False) -> nn.Module:
    # block-scaled all-gather: every shard holds whole blocks (128 rows over 8 ranks)
    preset = "moe_tiny" if moe else "tiny"
    kw = dict(dim=1024, n_heads=8, n_kv_heads=8, multiple_of=1024) if blocks else {}
    args = model_args(preset, **{"dim": 256, "multiple_of": 128, **kw}, n_layers=2)
    return Transformer(args)  # no init_weights: its redraw loop reads values


def _train_step(config, mesh, cap, *, ac=False, float8_rs=False, moe=False, tokens=256):
    """Convert, shard, one forward/backward on fake cuda; returns the op counts."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with fake_cuda(cap) as rules:
        with torch.device("cuda"):
            model = _model(moe=moe, blocks=config.cast_config_weight.block_shape is not None)
            data = torch.randint(0, 256, (2, tokens // 2 + 1))
        convert_to_float8_training(
            model, config=config, module_filter_fn=lambda m, fqn: fqn != "output"
        )
        for i, block in enumerate(model.blocks):
            if ac:
                block = model.blocks[i] = checkpoint_wrapper(block)
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        if float8_rs:
            enable_float8_reduce_scatter(model)
        logits = model(data[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), data[:, 1:].flatten())
        backward(loss)
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert not missing, f"no gradient for {missing}"
    return rules.calls


def _expect_collectives(calls, *, float8_rs=False) -> None:
    assert calls["_allgather_base_"] > 0, dict(calls)
    reduce = calls["alltoall_base_"] if float8_rs else calls["_reduce_scatter_base_"]
    assert reduce > 0, dict(calls)


# shard layouts the library refuses with a remedy (never a hang): per-row scales cannot take
# FSDP2's padded uneven shards; block scales need whole blocks in every shard
REFUSED = {
    ("dynamic_rowwise", "uneven_ws3"): "rows divisible by the shard count",
    ("rowwise_with_gw_hp", "uneven_ws3"): "rows divisible by the shard count",
    ("block_blockwise", "uneven_ws3"): "whole",
    ("block_mxfp8", "uneven_ws3"): "whole",
}


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_fsdp_weight_wrappers(wrapper, mesh_name):
    make, cap = WRAPPERS[wrapper]
    shape, names = MESHES[mesh_name]
    refused = REFUSED.get((wrapper, mesh_name))
    with fake_world(shape, names) as mesh:
        if refused:
            with pytest.raises(ValueError, match=refused):
                _train_step(make(enable_fsdp_float8_all_gather=True), mesh, cap)
            return
        calls = _train_step(make(enable_fsdp_float8_all_gather=True), mesh, cap)
    _expect_collectives(calls)


@pytest.mark.parametrize("wrapper", ["dynamic_tensorwise", "dynamic_rowwise", "delayed"])
def test_fsdp_activation_checkpointing(wrapper):
    make, cap = WRAPPERS[wrapper]
    with fake_world((8,)) as mesh:
        calls = _train_step(make(enable_fsdp_float8_all_gather=True), mesh, cap, ac=True)
    _expect_collectives(calls)


@pytest.mark.parametrize("wrapper", ["dynamic_tensorwise", "dynamic_rowwise"])
def test_fsdp_float8_reduce_scatter(wrapper):
    make, cap = WRAPPERS[wrapper]
    with fake_world((8,)) as mesh:
        calls = _train_step(make(enable_fsdp_float8_all_gather=True), mesh, cap, float8_rs=True)
    _expect_collectives(calls, float8_rs=True)


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_fsdp_experts(recipe):
    config = Float8LinearConfig.from_recipe_name(recipe, enable_fsdp_float8_all_gather=True)
    with fake_world((8,)) as mesh:
        calls = _train_step(config, mesh, H200, moe=True)
    _expect_collectives(calls)
    assert calls["_scaled_grouped_mm"] > 0, dict(calls)


def test_mx_weight_scales_are_swizzled_once_per_unshard():
    """MXFP8 on SM100: each GEMM swizzles the e8m0 scales of the activations it casts; a
    gathered weight's scales come swizzled, built once per unshard (the output GEMM's in
    forward, grad_input's in backward's re-gather), never inside a GEMM. Per linear and
    step: 3 GEMMs, 4 swizzles inside them (output: input; grad_input: grad_output;
    grad_weight: both), 2 outside (the weight's, one per weight GEMM)."""
    from unittest import mock

    from fsdp_float8.core import blocks_cuda

    make, cap = WRAPPERS["block_mxfp8"]
    swizzle, gemm = blocks_cuda.swizzle_32_4_4, blocks_cuda.cuda_block_scaled_mm
    depth, counts = [0], {"gemms": 0, "inside": 0, "outside": 0}

    def counted_swizzle(scale):
        counts["inside" if depth[0] else "outside"] += 1
        return swizzle(scale)

    def counted_gemm(*args, **kwargs):
        counts["gemms"] += 1
        depth[0] += 1
        try:
            return gemm(*args, **kwargs)
        finally:
            depth[0] -= 1

    with (
        mock.patch.object(blocks_cuda, "swizzle_32_4_4", counted_swizzle),
        mock.patch.object(blocks_cuda, "cuda_block_scaled_mm", counted_gemm),
        fake_world((8,)) as mesh,
    ):
        _train_step(make(enable_fsdp_float8_all_gather=True), mesh, cap)
    linears, rest = divmod(counts["gemms"], 3)
    assert linears > 0 and rest == 0, counts
    assert counts["inside"] == 4 * linears and counts["outside"] == 2 * linears, counts
