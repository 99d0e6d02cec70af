"""Optimizer and learning-rate schedule of ``f8train/train.py``: AdamW (decay on matrices
only) and a linear warmup followed by a cosine decay."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
from torch import nn


def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (norm weights are not decayed)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
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
