"""The float8 step is the library's: a training loop that calls no float8 function.

`convert_to_float8_training` installs a root forward pre-hook that refreshes, in one
collective, what the optimizer step made stale (precomputed scales of dynamic float8-gathered
weights, delayed-scaling syncs). Measured on 2 gloo ranks, every step (step 0 included):
- collectives per step = bf16's + 1, for dynamic tensorwise, delayed, and a mixed model
  (delayed activations, dynamic float8-gathered weights); step 0: + 2 (the first scales
  before the first forward, then the refresh after the optimizer step);
- losses equal, bit for bit, to the same training with the explicit calls
  (`precompute_float8_dynamic_scale_for_fsdp` / `sync_float8_amax_and_scale_history`
  before the first forward and after each optimizer step).
"""

from __future__ import annotations

from dataclasses import replace

from fsdp_float8 import convert_to_float8_training
from fsdp_float8.tools.comm_stats import CollectiveCounter
from tests.distributed.float8_cases import (
    Case,
    build_model,
    explicit_refresh,
    float8_config,
    float8_filter,
    shard_with_optimizer,
    train_and_count,
)
from tests.distributed.launcher import cpu_mesh, run_distributed

BASE = Case(steps=4)
CASES = [
    replace(BASE, recipe="off", fp8_all_gather=False),  # bf16 baseline
    BASE,  # dynamic tensorwise, float8 all-gather
    replace(BASE, scaling="delayed"),
    replace(BASE, scaling="mixed"),
]


def _train(case: Case, mesh, rank: int, world_size: int, explicit: bool):
    model = build_model(case)
    if case.recipe != "off":
        config = float8_config(case, all_gather=case.fp8_all_gather)
        convert_to_float8_training(model, config=config, module_filter_fn=float8_filter)
    opt = shard_with_optimizer(model, case, mesh)
    refresh = (lambda: explicit_refresh(model, case)) if explicit else None
    if refresh is not None:
        refresh()
    return train_and_count(
        model, opt, case, rank, world_size, count=CollectiveCounter.count, after_step=refresh
    )


def _grid(rank, world_size, cases):
    mesh = cpu_mesh(world_size)
    return [
        (_train(c, mesh, rank, world_size, False), _train(c, mesh, rank, world_size, True)[0])
        for c in cases
    ]


def test_no_float8_call_in_the_loop(tmp_path):
    results = run_distributed(_grid, 2, tmp_path, CASES, timeout_s=300)
    for per_rank in results:
        (_, bf16_counts), _ = per_rank[0]
        for case, ((losses, counts), explicit_losses) in zip(CASES[1:], per_rank[1:]):
            assert losses == explicit_losses, case.scaling
            extra = [c - b for c, b in zip(counts, bf16_counts, strict=True)]
            # step 0: the first scales before the first forward, then the refresh after the
            # optimizer step; every later step: that refresh alone
            assert extra[0] == 2 and extra[1:] == [1] * (len(extra) - 1), (case, counts)
