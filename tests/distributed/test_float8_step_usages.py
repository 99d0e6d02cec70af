"""The float8 step is exact however a training loop drives it (2 gloo ranks, FSDP2).

Each usage trains the same model (tensorwise dynamic scaling, float8 all-gather) for 3
steps and counts, per step (forward, backward, `optimizer.step()`), the *scale
collectives*: all-reduces with MAX (a refresh vector, or a weight's own amax; the ranks'
configs are compared through the store). Expected: exactly 1 in every steady step, 2 in
step 0 (the first scales before the first forward, then the refresh after the first
optimizer step; first scales per block when each block was converted alone); losses
equal, bit for bit, to the explicit-call run (the float8
step off, `precompute_float8_dynamic_scale_for_fsdp` before the first forward and after
each `optimizer.step()`, torchao's loop). Recipes with nothing to reduce (rowwise, mxfp8)
issue none in steady steps, whatever the user calls. Delayed scaling: one per step.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from fsdp_float8 import convert_to_float8_training, float8_step
from tests.distributed.float8_cases import (
    Case,
    build_model,
    explicit_refresh,
    float8_config,
    float8_filter,
    loss_of,
    scale_collectives,
    shard_with_optimizer,
    train_and_count,
)
from tests.distributed.launcher import cpu_mesh, run_distributed

CASE = Case(steps=3)
USAGES = (
    "no_call",
    "explicit_after_step",
    "precompute_as_optimizer_post_hook",
    "unrelated_optimizer",
    "gradient_accumulation",
    "converted_container",
    "converted_block_by_block",
)


def _convert(model: nn.Module, case: Case, usage: str) -> None:
    config = float8_config(case, all_gather=case.fp8_all_gather)
    if usage == "converted_container":
        convert_to_float8_training(model.blocks, config=config)
    elif usage == "converted_block_by_block":
        for block in model.blocks:
            convert_to_float8_training(block, config=config)
    else:
        convert_to_float8_training(model, config=config, module_filter_fn=float8_filter)


def _half_batches(model: nn.Module, case: Case, x: torch.Tensor) -> torch.Tensor:
    return sum(loss_of(model, case, half) / 2 for half in x.chunk(2))  # the same batch


def _train(case: Case, usage: str, mesh, rank: int, world_size: int):
    model = build_model(case)
    _convert(model, case, usage)
    opt = shard_with_optimizer(model, case, mesh)
    other = nn.Linear(8, 8)  # an EMA / probe: an optimizer that holds no float8 weight
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    if usage == "reference":
        float8_step(model).disable()
        explicit_refresh(model, case)
    if usage == "precompute_as_optimizer_post_hook":
        opt.register_step_post_hook(lambda *_: explicit_refresh(model, case))

    def after_step() -> None:
        if usage in ("explicit_after_step", "reference"):
            explicit_refresh(model, case)
        if usage == "unrelated_optimizer":
            other(torch.randn(2, 8)).sum().backward()
            other_opt.step()

    loss_fn = _half_batches if usage == "gradient_accumulation" else loss_of
    return train_and_count(
        model,
        opt,
        case,
        rank,
        world_size,
        count=scale_collectives,
        loss_fn=loss_fn,
        after_step=after_step,
    )


def _grid(rank, world_size, cases_and_usages):
    mesh = cpu_mesh(world_size)
    return [_train(c, u, mesh, rank, world_size) for c, u in cases_and_usages]


def _check(results, cases_and_usages, steady: int):
    for per_rank in results:
        out = dict(zip(cases_and_usages, per_rank, strict=True))
        for (case, usage), (losses, counts) in out.items():
            if usage == "reference":
                continue
            ref_losses, _ = out[(case, "reference")]
            assert counts[1:] == [steady] * (case.steps - 1), (case.scaling, usage, counts)
            # step 0: first scales per converted root (each block, converted alone), then
            # the refresh after the optimizer step; nothing at all when nothing is reduced
            roots = case.n_layers if usage == "converted_block_by_block" else 1
            assert counts[0] == steady * (1 + roots), (case.scaling, usage, counts)
            if usage != "gradient_accumulation":  # another sum order of the same loss
                assert losses == ref_losses, (case.scaling, usage, losses, ref_losses)


def test_tensorwise_one_scale_collective_per_step_in_every_usage(tmp_path):
    grid = [(CASE, u) for u in ("reference", *USAGES)]
    _check(run_distributed(_grid, 2, tmp_path, grid, timeout_s=600), grid, steady=1)


def test_delayed_one_collective_per_step(tmp_path):
    delayed = replace(CASE, scaling="delayed")
    usages = ("no_call", "explicit_after_step", "converted_container", "unrelated_optimizer")
    grid = [(delayed, u) for u in ("reference", *usages)]
    _check(run_distributed(_grid, 2, tmp_path, grid, timeout_s=600), grid, steady=1)


def test_nothing_to_reduce_no_scale_collective(tmp_path):
    mxfp8 = replace(CASE, recipe="mxfp8", model="mlp", dim=64, n_layers=1)
    grid = [
        (case, usage)
        for case in (replace(CASE, recipe="rowwise"), mxfp8)
        for usage in ("reference", "no_call", "explicit_after_step", "converted_container")
    ]
    _check(run_distributed(_grid, 2, tmp_path, grid, timeout_s=600), grid, steady=0)
