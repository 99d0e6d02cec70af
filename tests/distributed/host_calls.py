"""Library Python calls in one steady FSDP2 training step, counted per recipe.

Setting: 2 gloo ranks on CPU, a model of 2 blocks of 2 bias-free linears (64 -> 128 -> 64),
converted with `convert_to_float8_training` (float8 or NVFP4 all-gather on), `fully_shard`
on each block and on the root over an explicit CPU DeviceMesh, AdamW. After 3 warm-up
steps, one step (forward, backward, `optimizer.step()`, which runs the float8 step from its
optimizer hook) is counted on rank 0 with `sys.setprofile`: every 'call' event whose code
object's file lies inside the `fsdp_float8` package.

Run `python -m tests.distributed.host_calls [recipe ...]` to print the count per recipe and
the functions called most; `test_host_calls.py` asserts the counts stay under their limits.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from collections import Counter
from dataclasses import replace

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import fsdp_float8
from fsdp_float8 import Float8LinearConfig, NVFP4Config, convert_to_float8_training
from tests.distributed.launcher import cpu_mesh, run_distributed

DIM, WARMUP = 64, 3
RECIPES = ("tensorwise", "rowwise", "nvfp4")
PACKAGE = os.path.dirname(os.path.abspath(fsdp_float8.__file__)) + os.sep


def all_gather_config(recipe: str):
    """The recipe's config with float8 (NVFP4: FP4) all-gather on."""
    if recipe == "nvfp4":
        return NVFP4Config(enable_fsdp_float8_all_gather=True)
    return replace(Float8LinearConfig.from_recipe_name(recipe), enable_fsdp_float8_all_gather=True)


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(2 * DIM, DIM, bias=False))


def sharded_two_blocks(mesh, recipe: str, rank: int):
    """2 blocks of 2 bias-free linears (DIM -> 2 DIM -> DIM), converted per `recipe`, each
    block and the root `fully_shard`ed over `mesh`, with AdamW: `step(i)` runs training
    step i (forward, backward, optimizer step) on this rank's batch."""
    torch.manual_seed(0)
    model = nn.Sequential(_block(), _block())
    model = convert_to_float8_training(model, config=all_gather_config(recipe))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(i: int) -> None:
        x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(10 * i + rank))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    return model, step


def steady_step_calls(rank: int, world: int, recipe: str) -> Counter[str]:
    """The library calls of one steady step on this rank, by `file:line function`."""
    _model, step = sharded_two_blocks(cpu_mesh(world), recipe, rank)
    for i in range(WARMUP):
        step(i)
    gc.collect()  # the models of recipes measured before in this process: gone
    calls: Counter[str] = Counter()

    def profile(frame, event, _arg) -> None:
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(PACKAGE):
                name = code.co_filename[len(PACKAGE) :]
                calls[f"{name}:{code.co_firstlineno} {code.co_qualname}"] += 1

    sys.setprofile(profile)
    try:
        step(WARMUP)
    finally:
        sys.setprofile(None)
    return calls


def _all(rank: int, world: int, recipes: tuple[str, ...]) -> dict[str, Counter[str]]:
    return {recipe: steady_step_calls(rank, world, recipe) for recipe in recipes}


def measure(tmp_path: str, recipes: tuple[str, ...] = RECIPES) -> dict[str, Counter[str]]:
    """Rank 0's calls per recipe (2 ranks, one job)."""
    return run_distributed(_all, 2, tmp_path, recipes, timeout_s=240)[0]


def main(argv: list[str]) -> None:
    recipes = tuple(argv) or RECIPES
    with tempfile.TemporaryDirectory() as tmp:
        out = measure(tmp, recipes)
    for recipe, calls in out.items():
        print(f"{recipe}: {sum(calls.values())} library calls per steady step")
        for name, n in calls.most_common(25):
            print(f"  {n:5d}  {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
