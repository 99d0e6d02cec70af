"""The sharded model of ``f8train/train.py`` and its optimizer.

``build_model`` goes in torchtitan's order: Transformer on the meta device -> float8 swap of
the block linears -> tensor-parallel plan (``--tp``, ``f8train/tp_plan.py``) -> activation
checkpointing and torch.compile per block -> fully_shard per block, then the root ->
``to_empty(device)`` -> ``init_weights(seed)``. Each rank only ever allocates its shards and
gets the same values for any mesh. AdamW decays matrices only; the learning rate warms up
linearly, then follows a cosine.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from f8train.float8_flags import expert_filter, float8_filter
from f8train.model import Transformer, build_args
from f8train.process_group import Dist
from f8train.tp_plan import apply_tensor_parallel
from fsdp_float8 import Float8LinearConfig, convert_to_float8_training, enable_float8_reduce_scatter


def build_model(
    args: argparse.Namespace, d: Dist, config: Float8LinearConfig | None
) -> tuple[Transformer, object]:
    """The sharded, initialized model and its float8 conversion report (None if off)."""
    with torch.device("meta"):
        model = Transformer(build_args(args))
    report = None
    if config is not None:
        convert_to_float8_training(
            model,
            config=config,
            module_filter_fn=float8_filter(args.float8_skip),
            expert_filter_fn=expert_filter(args.float8_skip),
        )
        report = model.float8_conversion_report
    if d.tp_mesh is not None:  # after the float8 swap, before the wrappers and fully_shard
        apply_tensor_parallel(model, d.tp_mesh)
    for i, block in enumerate(model.blocks):
        if args.activation_checkpointing:
            block = checkpoint_wrapper(block)
        if args.compile:
            block.compile()  # in place: parameter names stay as they are
        model.blocks[i] = block
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if args.mixed_precision == "bf16" else None,
        reduce_dtype=torch.float32,
    )
    for block in model.blocks:
        fully_shard(block, mesh=d.mesh, mp_policy=mp)
    fully_shard(model, mesh=d.mesh, mp_policy=mp)
    if args.float8_reduce_scatter:
        enable_float8_reduce_scatter(model)
    model.to_empty(device=d.device)
    model.init_weights(args.seed)  # Float8Linear resets its delayed buffers in to_empty
    return model, report


def conversion_counts(model: nn.Module, report) -> dict[str, int]:
    """Global parameter counts: float8-converted linear and expert weights vs the rest."""
    names = set(report.converted) if report is not None else set()
    experts = set(report.experts_converted) if report is not None else set()
    converted = other = 0
    for fqn, p in model.named_parameters():
        fqn = fqn.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        if fqn.removesuffix(".weight") in names or fqn.rpartition(".")[0] in experts:
            converted += p.numel()
        else:
            other += p.numel()
    return {"float8_params": converted, "high_precision_params": other}


def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (norm weights are not decayed)."""
    groups = [
        {
            "params": [p for p in model.parameters() if p.ndim >= 2],
            "weight_decay": args.weight_decay,
        },
        {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)


@dataclass(frozen=True)
class WarmupCosine:
    """LR multiplier: linear warmup over ``warmup`` steps, then cosine decay to
    ``min_ratio`` at ``total``. A callable object, so LambdaLR's state_dict keeps it."""

    warmup: int
    total: int
    min_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, args: argparse.Namespace):
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    fn = WarmupCosine(warmup=warmup, total=args.steps, min_ratio=args.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
