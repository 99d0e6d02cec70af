"""Checkpoints of ``scripts/train.py`` with torch.distributed.checkpoint (DCP).

Mental model: a checkpoint is one DCP folder ``OUT/checkpoints/step_00000042/`` holding

- ``app``: model and optimizer state from ``get_state_dict`` (sharded DTensors; the
  delayed-scaling buffers are model buffers, so they come along), loaded back with
  ``set_state_dict``. Each rank writes its own shards; DCP reshards on load, so a
  checkpoint saved on 2 ranks loads on 1 or 4;
- ``scheduler`` (without its lambda: the schedule's shape comes from the resumed run's
  flags), ``batcher`` (the data position), ``rng`` and ``progress`` (step, tokens);
- ``manifest.json``, written after every rank's DCP files: each file's size and sha256 and
  the run settings the checkpoint depends on (``scripts/checkpoint_manifest.py``). A folder
  without it is an interrupted save and is ignored; ``scripts/resume.py`` verifies the
  files against it before anything is loaded.

Only the newest ``keep`` complete checkpoints are kept.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from scripts.checkpoint_manifest import MANIFEST, write_manifest

_PREFIX = "step_"
_STEP_DIR = re.compile(rf"{_PREFIX}(\d+)")


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
        return (Path(path) / MANIFEST).is_file()

    def complete(self) -> list[Path]:
        """Complete checkpoints (those with a manifest), oldest first."""
        return [p for p in self.step_dirs() if self.is_complete(p)]

    def step_dirs(self) -> list[Path]:
        """Folders named like a checkpoint (``step_N``), complete or not, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name)]
        return sorted(found, key=step_of)

    def latest(self) -> Path | None:
        found = self.complete()
        return found[-1] if found else None

    def path_for(self, step: int) -> Path:
        return self.root / f"{_PREFIX}{step:08d}"

    def save(self, step: int, state: dict[str, Stateful], settings: dict[str, Any]) -> Path:
        """DCP save, then the manifest of checksums (collective: every rank calls it)."""
        path = self.path_for(step)
        if self.is_main and path.exists():
            shutil.rmtree(path)  # an interrupted save, or a step a fallback trains again
        dist.barrier()
        dcp.save(state, checkpoint_id=path)
        dist.barrier()  # every rank's files are written
        write_manifest(path, step=step, settings=settings)
        dist.barrier()  # the manifest is in place before anyone prunes or reads it
        if self.is_main:
            self._prune()
        return path

    def load(self, path: Path, state: dict[str, Stateful]) -> None:
        """DCP load of a verified checkpoint; a failure names the checkpoint and exits."""
        try:
            dcp.load(state, checkpoint_id=path)
        except (CheckpointException, RuntimeError, KeyError, ValueError) as err:
            raise SystemExit(
                f"could not load checkpoint {path}, although its files match their "
                f"checksums: {_first_lines(err)}\nresume with the flags it was saved with "
                f"(see the run.json next to it), or use another --out"
            ) from None

    def _prune(self) -> None:
        complete = self.complete()
        newest = step_of(complete[-1]) if complete else -1
        for old in complete[: max(0, len(complete) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)
        for partial in self.step_dirs():  # interrupted saves older than the newest
            if not self.is_complete(partial) and step_of(partial) < newest:
                shutil.rmtree(partial, ignore_errors=True)


def _first_lines(err: BaseException, n: int = 6) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return "\n".join(lines[:n]) + ("\n..." if len(lines) > n else "")


def step_of(path: Path) -> int:
    match = _STEP_DIR.fullmatch(Path(path).name)
    return int(match.group(1)) if match else -1
