"""CUDA-only edges of the GEMM and FSDP2 contracts (marked `gpu`, skipped without CUDA).

- forward and backward through the real `torch._scaled_mm` with token counts that are
  not multiples of 16 (and a `Linear(32, 2)` head with `pad_inner_dim=True`), against the
  float32 emulation of the same casts;
- a float32 rowwise layer (whose GEMMs ask for float32, which the row-scaled kernel does
  not write) runs in float32 with the emulation's numbers;
- FSDP2 on one NCCL rank (shard size 1: FSDP2 skips the all-gather) with float8
  all-gather trains with the same losses as the unsharded model on the same GPU.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
from torch import nn

from fsdp_float8 import (
    Float8Linear,
    Float8LinearConfig,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
    sqnr_db,
)
from fsdp_float8.core.numerics import SQNR_DB

pytestmark = pytest.mark.gpu
RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]


def _fwd_bwd(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    out = layer(x)
    out.backward(grad)
    return out.detach(), x.grad, layer.weight.grad


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("tokens", [1, 5, 33, 100])
@pytest.mark.parametrize("dims", [(256, 128), (32, 2)], ids=str)
def test_real_scaled_mm_fwd_bwd_with_odd_token_counts(recipe, tokens, dims):
    torch.manual_seed(0)
    in_f, out_f = dims
    base = nn.Linear(in_f, out_f, bias=False, device="cuda", dtype=torch.bfloat16)
    pad = out_f % 16 != 0  # the narrow head needs N padded for the real GEMM
    real = Float8Linear.from_float(
        copy.deepcopy(base), Float8LinearConfig.from_recipe_name(recipe, pad_inner_dim=pad)
    )
    emul = Float8Linear.from_float(
        copy.deepcopy(base),
        Float8LinearConfig.from_recipe_name(recipe, pad_inner_dim=pad, emulate=True),
    )
    x = torch.randn(tokens, in_f, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(tokens, out_f, device="cuda", dtype=torch.bfloat16)
    got = _fwd_bwd(real, x, grad)
    want = _fwd_bwd(emul, x, grad)
    ref = _fwd_bwd(copy.deepcopy(base), x, grad)
    assert got[0].shape == (tokens, out_f)
    # the real GEMM accumulates in another order than the float32 emulation and rounds
    # its bf16 output once: the same bar as the existing real-vs-emulated check
    for a, b in zip(got, want, strict=True):
        assert sqnr_db(b.float(), a.float()) >= SQNR_DB["real_vs_emulated"] - 10
    if tokens > 1:  # one token: an SQNR of 1 value per row says little
        bars = ("linear_output", "linear_grad_input", "linear_grad_weight")
        for a, r, bar in zip(got, ref, bars, strict=True):
            assert sqnr_db(r.float(), a.float()) >= SQNR_DB[bar], bar


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_float32_layer_runs_in_float32(recipe):
    # the row-scaled kernel writes bf16 only: a float32 layer's row-scaled GEMMs run with
    # unit scales and a float32 output, the scales around them: the emulation's numbers
    torch.manual_seed(0)
    ref = nn.Linear(64, 64, bias=False, device="cuda")
    config = Float8LinearConfig.from_recipe_name(recipe)
    layer = Float8Linear.from_float(nn.Linear(64, 64, bias=False, device="cuda"), config)
    emulated = Float8Linear.from_float(
        nn.Linear(64, 64, bias=False, device="cuda"), dataclasses.replace(config, emulate=True)
    )
    for m in (layer, emulated):
        m.load_state_dict(ref.state_dict())
    x = torch.randn(16, 64, device="cuda")
    out, want, exact = layer(x), emulated(x), ref(x)
    assert out.dtype == torch.float32
    assert sqnr_db(want, out) >= SQNR_DB["real_vs_emulated"]
    assert sqnr_db(exact, out) >= SQNR_DB["linear_output"]


def _train(model: nn.Module, steps: int, dtype: torch.dtype) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    losses = []
    for _ in range(steps):
        x = torch.randn(24, 64, device="cuda", dtype=dtype, generator=g)  # 24: not /16
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "recipe,dtype", [("tensorwise", torch.float32), ("rowwise", torch.bfloat16)]
)
def test_fsdp_one_nccl_rank_matches_unsharded(tmp_path, recipe, dtype):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    model = model.to(device="cuda", dtype=dtype)
    config = Float8LinearConfig.from_recipe_name(recipe, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config)
    reference = copy.deepcopy(model)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        for block in (model[0], model[2]):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        precompute_float8_dynamic_scale_for_fsdp(model)
        sharded = _train(model, 5, dtype)
    finally:
        dist.destroy_process_group()
    unsharded = _train(reference, 5, dtype)
    assert sharded == unsharded
    assert sharded[-1] < sharded[0]
