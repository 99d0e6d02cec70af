"""Under FSDP2 (1 rank, explicit CPU mesh) a precomputed weight scale never goes stale.

After `precompute_float8_dynamic_scale_for_fsdp`, each mutation path changes the weight by
~1000x without a new precompute; the next forward must still match the high-precision
output within the float8 linear bar (a stale scale saturates every element: ~0 dB). The
paths include writes into `model.state_dict()` tensors and a `dcp.load` into them (a
rollback): the state dict holds a DTensor over the weight's inner tensor, whose writes the
wrapper must see. An optimizer step is followed by the float8 step's own refresh (the
scale is fresh again, from the new values); every other path leaves it stale.

Writes into the DTensors of `model.state_dict()` (`copy_`, `mul_`, `nn.init.*` on them, 2 ranks,
every recipe) are checked against a twin written through its parameters: the same next forward,
bit for bit.

The shard a forward packed for the all-gather is reused by the next all-gather while the
values stand (backward's re-gather, the next micro-batch): the rowwise test runs every path
after a forward that packed, so a pack kept across a write would show as a stale output.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdp_float8 import (
    Float8LinearConfig,
    NVFP4Config,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
    sqnr_db,
)
from fsdp_float8.core.numerics import SQNR_DB
from fsdp_float8.weight_wrappers.base import plain_weight
from tests.distributed.launcher import cpu_mesh, run_distributed

CONFIG = Float8LinearConfig.tensorwise(enable_fsdp_float8_all_gather=True)
ROWWISE = Float8LinearConfig.from_recipe_name("rowwise", enable_fsdp_float8_all_gather=True)


def _build(mesh, device="cpu", config=CONFIG) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        model = nn.Sequential(nn.Linear(32, 32, bias=False))
    convert_to_float8_training(model, config=config)
    fully_shard(model, mesh=mesh)
    return model


def _step(optimizer_cls, **kwargs):
    def mutate(model):
        opt = optimizer_cls(model.parameters(), **kwargs)
        model(torch.randn(4, 32)).pow(2).sum().backward()
        opt.step()

    return mutate


@torch.no_grad()
def _mul(model):
    model[0].weight.mul_(1000)


@torch.no_grad()
def _copy(model):
    model[0].weight.copy_(model[0].weight.detach() * 1000)


@torch.no_grad()
def _load(model):
    model.load_state_dict({k: v * 1000 for k, v in model.state_dict().items()})


@torch.no_grad()
def _state_dict_write(model):
    model.state_dict()["0.weight"].to_local().mul_(1000)


def _dcp_load(model):
    import tempfile

    import torch.distributed.checkpoint as dcp

    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1000)  # save the 1000x weights
        with tempfile.TemporaryDirectory() as d:
            dcp.save(model.state_dict(), checkpoint_id=d)
            for p in model.parameters():
                p.div_(1000)
            precompute_float8_dynamic_scale_for_fsdp(model)  # fresh for the 1x weights
            dcp.load(model.state_dict(), checkpoint_id=d)  # in place: back to 1000x


PATHS = {
    "mul_": _mul,
    "copy_": _copy,
    "data.mul_": lambda m: m[0].weight.data.mul_(1000),
    "adamw_foreach": _step(torch.optim.AdamW, lr=1.0, foreach=True),
    "adamw_for_loop": _step(torch.optim.AdamW, lr=1.0, foreach=False),
    "sgd": _step(torch.optim.SGD, lr=1000.0),
    "load_state_dict": _load,
    "state_dict_tensor_mul_": _state_dict_write,
    "dcp_load_into_state_dict": _dcp_load,
}
REFRESHED_BY_THE_STEP = {"adamw_foreach", "adamw_for_loop", "sgd"}


def _output_sqnr(model) -> tuple[bool, float]:
    x = torch.randn(16, 32)
    fresh = model[0].weight._local_tensor.has_fresh_precomputed_scale()
    with torch.no_grad():
        hp = plain_weight(model[0].weight)
        ref = x @ (hp.full_tensor() if isinstance(hp, DTensor) else hp).t()
        out = model(x)  # the root stays unsharded after a no-grad forward: read hp first
    return fresh, float(sqnr_db(ref, out))


def _paths(rank, world_size):
    mesh = cpu_mesh(world_size)
    results = {}
    for name, mutate in PATHS.items():
        model = _build(mesh)
        model(torch.randn(2, 32)).sum().backward()  # lazy init, resharded: as in training
        model.zero_grad()
        precompute_float8_dynamic_scale_for_fsdp(model)
        mutate(model)
        results[name] = _output_sqnr(model)
    # meta init: precompute (a scale of meta values), to_empty, load real weights
    real = _build(mesh).state_dict()
    model = _build(mesh, device="meta")
    precompute_float8_dynamic_scale_for_fsdp(model)
    model.to_empty(device="cpu")
    model.load_state_dict({k: v * 1000 for k, v in real.items()}, strict=True)
    results["meta_to_empty_load"] = _output_sqnr(model)
    return results


def test_no_stale_precomputed_scale_after_any_mutation(tmp_path):
    results = run_distributed(_paths, 1, tmp_path, timeout_s=120)[0]
    bad = {
        name: (fresh, round(sqnr, 1))
        for name, (fresh, sqnr) in results.items()
        if fresh != (name in REFRESHED_BY_THE_STEP) or not sqnr >= SQNR_DB["linear_output"]
    }
    assert not bad, f"(still fresh, output SQNR dB) after each path: {bad}"


def _rowwise_paths(rank, world_size):
    mesh = cpu_mesh(world_size)
    results = {}
    for name, mutate in PATHS.items():
        model = _build(mesh, config=ROWWISE)
        model(torch.randn(2, 32)).sum().backward()  # packs the shard, kept for reuse
        model.zero_grad()
        mutate(model)
        results[name] = _output_sqnr(model)[1]
    return results


def test_no_stale_rowwise_pack_after_any_mutation(tmp_path):
    results = run_distributed(_rowwise_paths, 1, tmp_path, timeout_s=120)[0]
    bad = {name: round(s, 1) for name, s in results.items() if not s >= SQNR_DB["linear_output"]}
    assert not bad, f"output SQNR dB after each path: {bad}"


# -- writes into the DTensors `model.state_dict()` returns, every recipe, 2 ranks --------------
# Each write is applied to one model through its state dict and to a twin through its
# parameters (a path the wrapper sees); the next forward must be the twin's, bit for bit.
STATE_DICT_RECIPES = {
    "tensorwise": CONFIG,
    "rowwise": ROWWISE,
    "mxfp8": Float8LinearConfig.from_recipe_name("mxfp8", enable_fsdp_float8_all_gather=True),
    "nvfp4": NVFP4Config(enable_fsdp_float8_all_gather=True),
}


def _dtensor_copy_(t):
    t.copy_(t * 3)


def _dtensor_mul_(t):
    t.mul_(3)


def _distribute_copy_(t):
    full = torch.randn(t.shape, generator=torch.Generator().manual_seed(7))
    t.copy_(distribute_tensor(full, t.device_mesh, t.placements))


def _init_normal_(t):
    torch.manual_seed(7)
    nn.init.normal_(t, std=3.0)


STATE_DICT_WRITES = {
    "copy_": _dtensor_copy_,
    "mul_": _dtensor_mul_,
    "copy_distribute_tensor": _distribute_copy_,
    "init.normal_": _init_normal_,
}


def _trained(mesh, config) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    convert_to_float8_training(model, config=config)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model


def _state_dict_writes(rank, world_size):
    mesh = cpu_mesh(world_size)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(99))
    results = {}
    for recipe, config in STATE_DICT_RECIPES.items():
        for name, write in STATE_DICT_WRITES.items():
            model, twin = _trained(mesh, config), _trained(mesh, config)
            with torch.no_grad():
                write(model.state_dict()["0.weight"])
                write(twin[0].weight)
                results[recipe, name] = torch.equal(model(x), twin(x))
    return results


def test_writes_into_state_dict_dtensors_are_seen_by_every_recipe(tmp_path):
    for results in run_distributed(_state_dict_writes, 2, tmp_path, timeout_s=180):
        stale = [key for key, same in results.items() if not same]
        assert not stale, f"(recipe, write) whose next forward is not the twin's: {stale}"
