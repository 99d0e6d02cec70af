"""The sharded model of ``f8train/train.py`` and its optimizer and LR schedule.

``build_model`` goes in torchtitan's order: Transformer on the meta device -> float8 swap ->
tensor-parallel plan (``--tp``) -> activation checkpointing and torch.compile per block ->
fully_shard per block, then the root -> ``to_empty(device)`` -> ``init_weights(seed)``, so
each rank only ever allocates its shards and gets the same values for any mesh.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from f8train.float8_flags import expert_filter, float8_filter, meta_model
from f8train.model import Transformer
from f8train.process_group import Dist
from f8train.tp_plan import apply_tensor_parallel
from fsdp_float8 import (
    Float8LinearConfig,
    NVFP4Config,
    convert_to_float8_training,
    enable_float8_reduce_scatter,
)


def build_model(
    args: argparse.Namespace, d: Dist, config: Float8LinearConfig | NVFP4Config | None
) -> tuple[Transformer, object]:
    """The sharded, initialized model and its float8 conversion report (None if off)."""
    model = meta_model(args)
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
    # reduce_dtype is explicit: with reduce_dtype=None, torch <= 2.14 reduces gradients in
    # param_dtype (bf16) and 2.15 reduces fp32 parameters' gradients in fp32 (twice the
    # reduce-scatter bytes); the run summary names it (`describe`: "reduce-fp32")
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if args.mixed_precision == "bf16" else None,
        reduce_dtype=torch.float32,
    )
    for i, block in enumerate(model.blocks):
        if args.activation_checkpointing:
            block = checkpoint_wrapper(block)
        if args.compile:
            block.compile()  # in place: parameter names stay as they are
        model.blocks[i] = fully_shard(block, mesh=d.mesh, mp_policy=mp)
    fully_shard(model, mesh=d.mesh, mp_policy=mp)
    if args.float8_reduce_scatter:
        enable_float8_reduce_scatter(model)
    model.to_empty(device=d.device)
    model.init_weights(args.seed)  # Float8Linear resets its delayed buffers in to_empty
    return model, report


def conversion_counts(model: nn.Module, report) -> dict:
    """``run.json``'s float8 fields: the converted and skipped layers, and the global parameter
    counts of the float8-converted linear and expert weights and of the rest."""
    converted = set(report.converted) | set(report.experts_converted) if report else set()
    total = float8 = 0
    for fqn, p in model.named_parameters():
        fqn = fqn.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        total += p.numel()
        float8 += p.numel() if fqn.rpartition(".")[0] in converted else 0
    return {
        "float8_params": float8,
        "high_precision_params": total - float8,
        "float8_converted": report.converted if report else [],
        "float8_skipped": report.skipped if report else {},
    }


def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (norm weights are not decayed)."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": args.weight_decay}, {"params": others}]
    return torch.optim.AdamW(
        groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=True
    )


@dataclass(frozen=True)
class WarmupCosine:
    """LR multiplier: linear warmup over ``warmup`` steps, then cosine decay to
    ``min_ratio`` at ``total``."""

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
