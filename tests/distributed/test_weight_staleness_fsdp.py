"""Under FSDP2 (1 rank, explicit CPU mesh) a precomputed weight scale never goes stale.

After `precompute_float8_dynamic_scale_for_fsdp`, each mutation path changes the weight by
~1000x without a new precompute; the next forward must still match the high-precision
output within the float8 linear bar (a stale scale saturates every element: ~0 dB). The
paths include writes into `model.state_dict()` tensors and a `dcp.load` into them (a
rollback): the state dict holds a DTensor over the weight's inner tensor, whose writes the
wrapper must see. An optimizer step is followed by the float8 step's own refresh (the
scale is fresh again, from the new values); every other path leaves it stale.

The shard a forward packed for the all-gather is reused by the next all-gather while the
values stand (backward's re-gather, the next micro-batch): the rowwise test runs every path
after a forward that packed, so a pack kept across a write would show as a stale output.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fsdp_float8 import (
    Float8LinearConfig,
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
