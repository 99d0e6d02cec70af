"""Selective activation checkpointing of float8 layers, per recipe, in a fresh process.

Op-level SAC replays a forward's ops by position and refuses a saved tensor mutated later,
so any first-use work inside a forward (a lazy probe) or an in-place op on a saved output
breaks it. Each recipe runs in a new process (`run_distributed` with one rank), where the
first float8 GEMM of the process is inside the checkpointed forward, under torchtitan's
policy (save compute-intensive ops and `aten.max`, recompute every second mm) and under a
save-everything policy; gradients equal, bit for bit, the run without checkpointing.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from fsdp_float8 import Float8LinearConfig, convert_to_float8_training
from tests.distributed.launcher import run_distributed

aten = torch.ops.aten
_SAVE = {aten.mm.default, aten._scaled_mm.default, aten.addmm.default, aten.max.default}


def _titan_policy():
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if op == aten.mm.default:
            counts[mode] += 1
        second_mm = op == aten.mm.default and counts[mode] % 2 == 0
        if op in _SAVE and not second_mm:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _save_everything(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE


def _grads(config: Float8LinearConfig, policy) -> list[torch.Tensor]:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    convert_to_float8_training(block, config=config)
    x = torch.randn(2, 64, 128, requires_grad=True)
    if policy is None:
        out = block(x)
    else:
        context = functools.partial(create_selective_checkpoint_contexts, policy)
        out = checkpoint(block, x, use_reentrant=False, context_fn=context)
    out.float().square().mean().backward()
    return [x.grad, *(p.grad for p in block.parameters())]


def _sac(rank: int, world_size: int, recipe: str) -> list[bool]:
    config = Float8LinearConfig.from_recipe_name(recipe)
    titan = _grads(config, _titan_policy())  # the process's first float8 GEMM is in here
    everything = _grads(config, _save_everything)
    plain = _grads(config, None)
    return [torch.equal(a, b) for run in (titan, everything) for a, b in zip(run, plain)]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"])
def test_selective_activation_checkpointing_in_a_fresh_process(tmp_path, recipe):
    (equal,) = run_distributed(_sac, 1, tmp_path, recipe, timeout_s=180)
    assert all(equal), equal
