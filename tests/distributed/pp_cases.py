"""Shared pieces of the pipeline-parallel tests: a residual MLP split in two stages on a
("pp", "dp") = (2, 2) CPU mesh, each stage converted, `fully_shard`ed on its dp sub-mesh and
given AdamW, trained by torch.distributed.pipelining; and the one-process reference that
runs the same microbatches with the gradients accumulated the same way.

Everything here runs inside `run_distributed` children, so it is module level and picklable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from fsdp_float8 import CastConfig, Float8LinearConfig, convert_to_float8_training
from fsdp_float8.tools.comm_stats import CollectiveCounter

DIM, HIDDEN, N_BLOCKS, N_STAGES, DP = 32, 64, 4, 2, 2
MICROBATCH_ROWS = 4
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
_DELAYED = CastConfig(scaling_type="delayed")


@dataclass(frozen=True)
class PPCase:
    recipe: str = "tensorwise"  # tensorwise | rowwise | delayed
    schedule: str = "gpipe"  # gpipe | 1f1b
    example_inputs: bool = True  # PipelineStage(input_args=..., output_args=...) or None
    microbatches: int = 2
    steps: int = 4


def float8_config(recipe: str, emulate: bool = True) -> Float8LinearConfig:
    """`emulate`: the float8 GEMMs in float32 on the float8 values (the same casts, scales
    and state; CPU torch._scaled_mm takes ~10 ms per GEMM of these tiny shapes)."""
    if recipe == "delayed":
        return Float8LinearConfig(
            cast_config_input=_DELAYED,
            cast_config_weight=_DELAYED,
            cast_config_grad_output=_DELAYED,
            emulate=emulate,
        )
    all_gather = recipe == "tensorwise"  # float8 all-gather, as torchtitan's tensorwise runs
    return Float8LinearConfig.from_recipe_name(
        recipe, enable_fsdp_float8_all_gather=all_gather, emulate=emulate
    )


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.relu(self.w1(x)))


def build_blocks(recipe: str, stage: int | None = None) -> nn.Sequential:
    """The whole model (stage None) or one stage's blocks, converted; same init everywhere."""
    torch.manual_seed(0)
    blocks = [Block() for _ in range(N_BLOCKS)]
    per_stage = N_BLOCKS // N_STAGES
    if stage is not None:
        blocks = blocks[stage * per_stage : (stage + 1) * per_stage]
    return convert_to_float8_training(nn.Sequential(*blocks), config=float8_config(recipe))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target).pow(2).mean()


def global_batch(step: int, case: PPCase) -> tuple[torch.Tensor, torch.Tensor]:
    """All dp ranks' inputs and targets of a step: (DP, microbatches * rows, DIM) each."""
    g = torch.Generator().manual_seed(1000 + step)
    shape = (DP, case.microbatches * MICROBATCH_ROWS, DIM)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def train_pipeline(case: PPCase, mesh, rank: int) -> dict:
    """One stage's part of the pipeline run: per-step losses (last stage: the mean over the
    dp ranks' microbatches), and per-step scale collectives (all-reduce MAX) by group."""
    stage_idx, dp_rank = mesh.get_coordinate()
    dp_mesh, pp_group = mesh["dp"], mesh.get_group("pp")
    part = build_blocks(case.recipe, stage_idx)
    for block in part:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(part, mesh=dp_mesh)
    opt = torch.optim.AdamW(part.parameters(), lr=1e-2)
    example = {}
    if case.example_inputs:
        # a later stage's input carries the gradient back; every output does
        x_mb = torch.empty(MICROBATCH_ROWS, DIM, requires_grad=stage_idx > 0)
        out_mb = torch.empty(MICROBATCH_ROWS, DIM, requires_grad=True)
        example = {"input_args": (x_mb,), "output_args": (out_mb,)}
    stage = PipelineStage(part, stage_idx, N_STAGES, torch.device("cpu"), group=pp_group, **example)
    schedule = SCHEDULES[case.schedule](stage, n_microbatches=case.microbatches, loss_fn=loss_fn)
    dp_name = dp_mesh.get_group().group_name
    losses, counts = [], []
    for step in range(case.steps):
        x, y = (t[dp_rank] for t in global_batch(step, case))
        mb_losses: list[torch.Tensor] = []
        with CollectiveCounter() as counter:
            if stage_idx == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=mb_losses)
            opt.step()
            opt.zero_grad()
        scale = [r for r in counter.records if str(r.kind) == "all_reduce" and r.reduce_op == "max"]
        counts.append(
            {
                "dp": sum(r.group_name == dp_name for r in scale),
                "other": sum(r.group_name != dp_name for r in scale),
            }
        )
        if mb_losses:
            total = torch.stack(mb_losses).mean().detach()
            dist.all_reduce(total, group=dp_mesh.get_group())
            losses.append(total.item() / DP)
    return {"stage": stage_idx, "losses": losses, "counts": counts}


REFERENCE_ORDERS = ("forward", "reverse", "predivide")


def train_reference(case: PPCase, order: str = "forward") -> list[float]:
    """The same training in one process: per step, every dp rank's microbatches run through
    the whole model; each dp rank's gradients are summed over its microbatches and divided
    by their number (pipelining's scale_grads), then averaged over the dp ranks (FSDP2's
    reduce-scatter). Per-step mean loss. `order` picks one of the equally valid roundings:
    microbatches 0..n-1 ("forward") or n-1..0 ("reverse"), or each dp rank's sum divided
    by the dp size before the dp sum ("predivide")."""
    model = build_blocks(case.recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params = list(model.parameters())
    losses = []
    for step in range(case.steps):
        xs, ys = global_batch(step, case)
        total = [torch.zeros_like(p) for p in params]
        step_losses = []
        for d in range(DP):
            mbs = list(range(case.microbatches))
            for m in reversed(mbs) if order == "reverse" else mbs:
                rows = slice(m * MICROBATCH_ROWS, (m + 1) * MICROBATCH_ROWS)
                loss = loss_fn(model(xs[d, rows]), ys[d, rows])
                loss.backward()
                step_losses.append(loss.detach())
            div = case.microbatches * (DP if order == "predivide" else 1)
            for t, p in zip(total, params, strict=True):
                t += p.grad / div
                p.grad = None
        for t, p in zip(total, params, strict=True):
            p.grad = t if order == "predivide" else t / DP
        opt.step()
        opt.zero_grad()
        losses.append(torch.stack(step_losses).mean().item())
    return losses
