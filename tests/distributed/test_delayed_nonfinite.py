"""Delayed scaling under FSDP2 (2 gloo ranks) after a batch whose loss is NaN, skipped by
the usual guard (the loss all-reduced, so every rank skips the same step). The non-finite
amaxes never reach the history, and the cross-rank sync carries on from the finite ones:
- NaN in every rank's batch: every recorded activation amax is NaN and the weights are
  unchanged until the next forward, so training goes on bit for bit as if the batch had
  never been drawn;
- NaN in rank 0's batch only: rank 1's finite amaxes of that batch count as a micro-batch's
  would; every later loss is finite and no later step is skipped. Rank 0 counts one
  non-finite amax per layer input, rank 1 none.
The single-process case is in tests/unit/test_delayed_nonfinite.py."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from fsdp_float8 import convert_to_float8_training
from fsdp_float8.core.delayed_state import nonfinite_amaxes
from tests.distributed.launcher import cpu_mesh, run_distributed
from tests.unit.test_delayed_nonfinite import BAD_STEP, CONFIG, STEPS, _Residual

POISONED_RANKS = {"none": (), "all": (0, 1), "rank0": (0,)}


def _batch(step: int, rank: int, poisoned: tuple[int, ...]) -> torch.Tensor:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * rank + step))
    if step == BAD_STEP and rank in poisoned:
        x[2, 7] = math.nan
    return x


def _train(rank: int, mesh, poison: str) -> tuple[list[float], dict[str, int]]:
    torch.manual_seed(0)
    model = convert_to_float8_training(_Residual(), config=CONFIG)
    for layer in model.mlp:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        if poison == "none" and step == BAD_STEP:
            continue
        loss = model(_batch(step, rank, POISONED_RANKS[poison])).pow(2).mean()
        seen = loss.detach().clone()
        dist.all_reduce(seen)  # the guard's global loss: every rank skips alike
        if not torch.isfinite(seen):
            opt.zero_grad()
            continue
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(seen.item())
    return losses, nonfinite_amaxes(model)


def _grid(rank: int, world_size: int) -> dict:
    mesh = cpu_mesh(world_size)
    return {poison: _train(rank, mesh, poison) for poison in POISONED_RANKS}


def test_a_skipped_nan_batch_under_fsdp2(tmp_path) -> None:
    results = run_distributed(_grid, 2, tmp_path, timeout_s=240)
    for rank, per_case in enumerate(results):
        reference, _ = per_case["none"]
        losses, counts = per_case["all"]
        assert losses == reference, rank
        assert counts == {"mlp.0.input": 1, "mlp.2.input": 1}, (rank, counts)
        losses, counts = per_case["rank0"]
        assert len(losses) == len(reference) and all(map(math.isfinite, losses)), losses
        want = {"mlp.0.input": 1, "mlp.2.input": 1} if rank == 0 else {}
        assert counts == want, (rank, counts)
