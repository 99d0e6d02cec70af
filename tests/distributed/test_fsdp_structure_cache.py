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

from torch.nn.modules.module import register_module_parameter_registration_hook

from fsdp_float8.fsdp import structure
from tests.distributed.host_calls import sharded_two_blocks
from tests.distributed.launcher import cpu_mesh, run_distributed

WARMUP, STEADY = 2, 5
RECIPES = ("tensorwise", "rowwise", "mxfp8", "nvfp4")


def _counts(rank: int, world: int, recipe: str) -> dict:
    _model, step = sharded_two_blocks(cpu_mesh(world), recipe, rank)
    hooks = [0]

    def count(*_args) -> None:
        hooks[0] += 1

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
