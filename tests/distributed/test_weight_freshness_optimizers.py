"""Float8-gathered weights follow an optimizer step whose kernels the wrappers cannot see.

A compiled `optimizer.step` (`torch.compile(opt.step)`, inductor), a fused kernel of another
library or a low-bit optimizer writes the weights below the wrappers' `__torch_dispatch__`:
neither the wrappers' mutation generation nor their inner tensors' versions move. The next
forward must still use float8 weights cast from the new values: the losses of a model with
float8 all-gather equal, bit for bit, those of its twin that all-gathers in high precision
(fp32, 2 ranks: the two are bit-identical, `test_fsdp_parity.py`).

`_KernelSGD` stands in for such a kernel (an inductor-compiled step takes minutes to compile
on a CPU): it writes each shard through `.data` of its storage, a tensor with a version
counter of its own.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fsdp_float8 import Float8LinearConfig, convert_to_float8_training
from fsdp_float8.weight_wrappers.base import plain_weight
from tests.distributed.launcher import cpu_mesh, run_distributed

RECIPES = ("tensorwise", "rowwise")


class _KernelSGD(torch.optim.Optimizer):
    """SGD whose update reaches the weights' storage the way a compiled kernel does."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                weight = plain_weight(p)
                local = weight.to_local() if isinstance(weight, DTensor) else weight
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                local.data.add_(grad, alpha=-group["lr"])


def _model(recipe: str, gather: bool, mesh) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.GELU(), nn.Linear(128, 64, bias=False))
    config = Float8LinearConfig.from_recipe_name(recipe, enable_fsdp_float8_all_gather=gather)
    convert_to_float8_training(model, config=config)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _losses(recipe: str, gather: bool, mesh, rank: int) -> list[float]:
    model = _model(recipe, gather, mesh)
    opt = _KernelSGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(4):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _twins(rank: int, world_size: int) -> dict:
    mesh = cpu_mesh(world_size)
    return {
        recipe: (_losses(recipe, True, mesh, rank), _losses(recipe, False, mesh, rank))
        for recipe in RECIPES
    }


def test_an_optimizer_step_below_the_wrappers_still_refreshes_the_weights(tmp_path):
    for results in run_distributed(_twins, 2, tmp_path, timeout_s=180):
        stale = {r: (f8, hp) for r, (f8, hp) in results.items() if f8 != hp}
        assert not stale, f"recipe: (float8 all-gather losses, high-precision twin's): {stale}"
