"""Shared setup of the checkpoint tests (test_checkpoint_integrity, test_checkpoint_keep):
a small FSDP2 model with its optimizer, the trainer's resume arguments, and what
`find_resume` (what `f8train.train` runs before building its model) decides. Runs inside
`run_distributed` children, so everything is module level."""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from f8train.checkpoint import Checkpointer
from f8train.resume import find_resume
from tests.distributed.launcher import cpu_mesh


def model_and_optimizer(world_size: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    mesh = cpu_mesh(world_size)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def resume_args(out: Path, resume: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(
        out=str(out), resume=resume, auto_resume=True, allow_recipe_change=False
    )


def find_resume_outcome(args: argparse.Namespace, ckpt: Checkpointer, settings: dict):
    """(the resume point or None, the message find_resume stopped with or None, what it
    wrote to stderr)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            point = find_resume(args, ckpt, settings)
    except SystemExit as stop:
        return None, str(stop), err.getvalue()
    return point, None, err.getvalue()
