"""A steady FSDP2 training step keeps the float8 step's structure cache, for every recipe.

FSDP2 swaps each sharded parameter in and out of its module around every unshard and
reshard. When the module's class keeps `nn.Module.__setattr__`, FSDP2 takes its fast path
(a plain dict write, no parameter-registration hook); a class that overrides `__setattr__`
sends every swap through `register_parameter`, which fires torch's global registration
hooks, and the float8 step's structure (fsdp_float8/fsdp/structure.py) is rebuilt at each
step. On 2 gloo ranks, 2 blocks of 2 linears, each block and the root `fully_shard`ed,
float8 (NVFP4) all-gather on: after 2 warm-up steps, 5 steps rebuild no structure and fire
no parameter-registration hook (tensorwise, rowwise, mxfp8, nvfp4).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.modules.module import register_module_parameter_registration_hook

from fsdp_float8 import Float8LinearConfig, NVFP4Config, convert_to_float8_training
from fsdp_float8.fsdp import structure
from tests.distributed.launcher import cpu_mesh, run_distributed

DIM, WARMUP, STEADY = 64, 2, 5
RECIPES = ("tensorwise", "rowwise", "mxfp8", "nvfp4")


def _config(recipe: str):
    if recipe == "nvfp4":
        return NVFP4Config(enable_fsdp_float8_all_gather=True)
    return replace(Float8LinearConfig.from_recipe_name(recipe), enable_fsdp_float8_all_gather=True)


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(2 * DIM, DIM, bias=False))


def _counts(rank: int, world: int, recipe: str) -> dict:
    mesh = cpu_mesh(world)
    torch.manual_seed(0)
    model = convert_to_float8_training(nn.Sequential(_block(), _block()), config=_config(recipe))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hooks = [0]

    def count(*_args) -> None:
        hooks[0] += 1

    def step(i: int) -> None:
        x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(10 * i + rank))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    for i in range(WARMUP):
        step(i)
    builds = structure.builds()
    handle = register_module_parameter_registration_hook(count)
    try:
        for i in range(WARMUP, WARMUP + STEADY):
            step(i)
    finally:
        handle.remove()
    return {"rebuilds": structure.builds() - builds, "registrations": hooks[0]}


def _all(rank: int, world: int) -> dict:
    return {recipe: _counts(rank, world, recipe) for recipe in RECIPES}


def test_steady_fsdp_steps_rebuild_no_structure_and_register_no_parameter(tmp_path):
    for out in run_distributed(_all, 2, tmp_path, timeout_s=240):
        assert out == {r: {"rebuilds": 0, "registrations": 0} for r in RECIPES}, out
