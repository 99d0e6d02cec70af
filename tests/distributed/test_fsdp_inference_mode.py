"""`torch.inference_mode()` forwards under FSDP2 with float8 and NVFP4 all-gather, 2 gloo ranks.

For each recipe, a model whose first forward runs under inference mode (before any training
step, so it is also FSDP2's lazy init) and again between training steps trains with the same
losses, bit for bit, as its twin that never ran one; the inference outputs equal a no-grad
forward of the twin at the same point.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from fsdp_float8 import Float8LinearConfig, NVFP4Config, convert_to_float8_training
from tests.distributed.launcher import cpu_mesh, run_distributed

DIM = 64
RECIPES = {
    "tensorwise": Float8LinearConfig.tensorwise(enable_fsdp_float8_all_gather=True),
    "rowwise": Float8LinearConfig.from_recipe_name("rowwise", enable_fsdp_float8_all_gather=True),
    "mxfp8": Float8LinearConfig.from_recipe_name("mxfp8", enable_fsdp_float8_all_gather=True),
    "nvfp4": NVFP4Config(enable_fsdp_float8_all_gather=True),
}


def _model(mesh, config) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False))
    convert_to_float8_training(model, config=config)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(16, DIM, generator=torch.Generator().manual_seed(10 * step + rank))


def _train(model, rank: int, inference: bool) -> tuple[list[float], list[torch.Tensor]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, evals = [], []
    for step in range(3):
        x = _batch(99, rank)
        if inference:
            with torch.inference_mode():
                evals.append(model(x).clone())
        else:
            with torch.no_grad():
                evals.append(model(x))
        loss = model(_batch(step, rank)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, evals


def _grid(rank: int, world_size: int) -> dict:
    mesh = cpu_mesh(world_size)
    results = {}
    for name, config in RECIPES.items():
        losses, evals = _train(_model(mesh, config), rank, inference=True)
        want_losses, want_evals = _train(_model(mesh, config), rank, inference=False)
        same_evals = all(torch.equal(a, b) for a, b in zip(evals, want_evals, strict=True))
        results[name] = (losses == want_losses, same_evals)
    return results


def test_inference_mode_forwards_then_training(tmp_path):
    for results in run_distributed(_grid, 2, tmp_path, timeout_s=180):
        assert all(all(r) for r in results.values()), results
