"""CUDA checks (marked `gpu`, skipped without CUDA): the real float8 GEMM against emulation
for every recipe, the batched CUDA amax against the per-tensor one, delayed scales made
ready on the host by a later refresh's non-blocking read (compiled: the same numbers as
eager), and a one-rank NCCL FSDP2 step with float8 all-gather."""

from __future__ import annotations

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
from fsdp_float8.core.scaling import axis_amax, tensor_amax, tensor_amaxes

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_real_scaled_mm_matches_emulation_on_cuda(recipe):
    torch.manual_seed(0)
    base = nn.Linear(256, 512, bias=False, device="cuda", dtype=torch.bfloat16)
    real = Float8Linear.from_float(base, Float8LinearConfig.from_recipe_name(recipe))
    emul = Float8Linear.from_float(base, Float8LinearConfig.from_recipe_name(recipe, emulate=True))
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = base(x)
        assert sqnr_db(emul(x), real(x)) >= SQNR_DB["real_vs_emulated"] - 10
        assert sqnr_db(ref, real(x)) >= SQNR_DB["linear_output"]


def test_batched_cuda_amax_equals_per_tensor_amax():
    # on CUDA tensor_amaxes takes one _foreach_norm(inf) kernel; it must give the same
    # numbers as tensor_amax (aminmax), which the CPU and every single cast use
    torch.manual_seed(0)
    ts = [
        torch.randn(n, 64, device="cuda", dtype=dt) * n
        for n in (3, 17, 128)
        for dt in (torch.float32, torch.bfloat16)
    ]
    got = tensor_amaxes(ts)
    assert all(g.dtype == torch.float32 and g.shape == () for g in got)
    assert torch.equal(torch.stack(got), torch.stack([tensor_amax(t) for t in ts]))
    for t in ts:  # the CUDA axis amax (one aminmax pass) against the CPU one (amin, amax)
        for dim in (0, -1):
            assert torch.equal(axis_amax(t, dim).cpu(), axis_amax(t.cpu(), dim))


def test_delayed_scales_become_ready_and_compiled_steps_match_eager_on_cuda():
    # the first sync queues a non-blocking read of the initialized flags; the next refresh
    # (here the second sync) reads it once it has landed: from then on the casts take the
    # synced scale as it is, and the compiled layer recompiles once, with the same numbers
    from fsdp_float8 import CastConfig, sync_float8_amax_and_scale_history

    delayed = CastConfig(scaling_type="delayed")
    config = Float8LinearConfig(
        cast_config_input=delayed, cast_config_weight=delayed, cast_config_grad_output=delayed
    )
    torch.manual_seed(0)
    base = nn.Linear(256, 512, bias=False, device="cuda", dtype=torch.bfloat16)
    eager = Float8Linear.from_float(base, config)
    compiled_layer = Float8Linear.from_float(
        nn.Linear(256, 512, bias=False, device="cuda", dtype=torch.bfloat16), config
    )
    compiled_layer.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_layer, fullgraph=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for step in range(4):
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        outs = []
        for layer, fn in ((eager, eager), (compiled_layer, compiled)):
            xi = x.clone().requires_grad_()
            out = fn(xi)
            out.float().square().sum().backward()
            outs.append((out.detach(), xi.grad, layer.weight.grad.clone()))
            layer.zero_grad()
            sync_float8_amax_and_scale_history(layer)
            torch.cuda.synchronize()
        for a, b in zip(*outs, strict=True):
            assert sqnr_db(a.float(), b.float()) >= SQNR_DB["real_vs_emulated"], step
    for layer in (eager, compiled_layer):
        state = layer.delayed_scaling
        assert state.ready_ops == set(state.operands)


def test_fsdp_float8_all_gather_one_rank_nccl(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda()
        config = Float8LinearConfig.tensorwise(enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=config)
        fully_shard(model, mesh=mesh)
        precompute_float8_dynamic_scale_for_fsdp(model)
        loss = model(torch.randn(32, 256, device="cuda")).square().mean()
        loss.backward()
        assert torch.isfinite(loss)
    finally:
        dist.destroy_process_group()
