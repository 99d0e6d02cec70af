"""Checkpoints of ``scripts/train.py`` with torch.distributed.checkpoint (DCP), graceful stop
on SIGTERM, and the crash hook used to test restarts.

Mental model: a checkpoint is one DCP folder ``OUT/checkpoints/step_00000042/`` holding

- ``app``: model and optimizer state from ``get_state_dict`` (sharded DTensors; the
  delayed-scaling buffers are model buffers, so they come along), loaded back with
  ``set_state_dict``. Each rank writes its own shards; DCP reshards on load, so a
  checkpoint saved on 2 ranks loads on 1 or 4;
- ``scheduler`` (without its lambda: the schedule's shape comes from the resumed run's
  flags), ``batcher`` (the data position), ``rng`` and ``progress`` (step, tokens).

DCP writes ``.metadata`` last, so a folder without it is an interrupted save and is
ignored. Only the newest ``keep`` complete checkpoints are kept.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

_PREFIX = "step_"


class ModelOptimizerState(Stateful):
    """Model + optimizer through DCP's state-dict helpers (FQNs without wrapper prefixes)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )


class SchedulerState(Stateful):
    """An LR scheduler's counters, without ``lr_lambdas`` (rebuilt from the flags)."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.__dict__.update(state_dict)


class RNGState(Stateful):
    """The torch RNG states (CPU, and the current CUDA device's); identical on all ranks,
    since every rank seeds the same, so a resharded resume can restore them too."""

    def state_dict(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["cpu"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])


class ProgressState(Stateful):
    """Where the run is: the last completed step and the tokens trained on so far."""

    def __init__(self) -> None:
        self.step = 0
        self.tokens = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens = int(state_dict["tokens"])


class Checkpointer:
    """Save/load/find the DCP checkpoints under ``root``; ``keep`` newest are kept."""

    def __init__(self, root: Path, *, keep: int, is_main: bool) -> None:
        self.root = Path(root)
        self.keep = keep
        self.is_main = is_main

    @staticmethod
    def is_complete(path: Path) -> bool:
        return (path / ".metadata").is_file()

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob(f"{_PREFIX}*") if self.is_complete(p)]
        return sorted(found, key=step_of)

    def latest(self) -> Path | None:
        found = self.complete()
        return found[-1] if found else None

    def path_for(self, step: int) -> Path:
        return self.root / f"{_PREFIX}{step:08d}"

    def save(self, step: int, state: dict[str, Stateful]) -> Path:
        path = self.path_for(step)
        if self.is_main and path.exists() and not self.is_complete(path):
            shutil.rmtree(path)  # an interrupted earlier save of this step
        dist.barrier()
        dcp.save(state, checkpoint_id=path)
        dist.barrier()
        if self.is_main:
            self._prune()
        return path

    def load(self, path: Path, state: dict[str, Stateful]) -> None:
        if not self.is_complete(Path(path)):
            raise SystemExit(
                f"checkpoint {path} is incomplete or missing (no .metadata); expected a "
                f"folder written by scripts.train, e.g. {self.path_for(100)}"
            )
        dcp.load(state, checkpoint_id=path)

    def _prune(self) -> None:
        complete = self.complete()
        newest = step_of(complete[-1]) if complete else -1
        for old in complete[: max(0, len(complete) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)
        for partial in self.root.glob(f"{_PREFIX}*"):  # interrupted saves older than newest
            if not self.is_complete(partial) and step_of(partial) < newest:
                shutil.rmtree(partial, ignore_errors=True)


def step_of(path: Path) -> int:
    try:
        return int(Path(path).name.removeprefix(_PREFIX))
    except ValueError:
        return -1


def resume_source(args: argparse.Namespace, ckpt: Checkpointer) -> Path | None:
    if args.resume not in (None, "latest"):
        return Path(args.resume)
    latest = ckpt.latest()
    if args.resume == "latest" and latest is None:
        raise SystemExit(f"--resume: no complete checkpoint under {ckpt.root}")
    if latest is not None and args.resume is None and not args.auto_resume:
        raise SystemExit(
            f"--out {args.out} already holds checkpoints (latest {latest}); pass --resume to "
            "continue that run, or choose another --out"
        )
    return latest


class GracefulStop:
    """SIGTERM/SIGINT set a flag the training loop checks once per step (all ranks agree
    through the per-step all-reduce), so the run saves a checkpoint and exits cleanly. A
    second signal falls back to the default behaviour."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.requested:  # second signal: stop now
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            os.kill(os.getpid(), signum)
            return
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def __enter__(self) -> GracefulStop:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def maybe_crash(step: int, crash_at_step: int | None, rank: int, world: int, out: Path) -> None:
    """Test hook (``--crash-at-step K``): the last rank exits abruptly after step K, the
    first time only (a marker file in ``out`` remembers it), so that ``torchrun
    --max-restarts 1`` restarts the job and it resumes from the latest checkpoint."""
    if crash_at_step is None or step != crash_at_step or rank != world - 1:
        return
    marker = Path(out) / f".crashed_at_step_{step}"
    if marker.exists():
        return
    marker.touch()
    print(f"[rank {rank}] --crash-at-step {step}: exiting abruptly (test hook)", flush=True)
    sys.stderr.flush()
    os._exit(17)
