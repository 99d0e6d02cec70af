"""Checkpoints of ``f8train.train``: one DCP folder per save, ``OUT/checkpoints/step_00000042/``.

A save writes the ``Stateful`` objects below (DCP reshards on load: a 2-rank checkpoint loads
on 1 or 4), then ``manifest.json`` (``f8train.checkpoint_manifest``: each file's size and
sha256, and the run settings), which marks a finished save; ``verify`` checks a folder
against it and gives every rank the same sorted findings. Nothing in a folder is opened
before the folder is verified against its manifest, and a folder without a valid manifest
is never loaded. Loading runs no code from the folder: DCP's files are pickles, read
through ``f8train.dcp_safe`` (``.metadata`` with an allow-list of DCP's metadata classes,
the tensors and the non-tensor items ``weights_only``).
Nothing that could load is deleted: a folder without a manifest is an interrupted save only
when ``dcp_problem`` (file names alone) finds DCP's files missing; one in a save's way is
renamed ``step_N.set_aside``.
"""

from __future__ import annotations

import errno
import re
import resource
import shutil
import sys
from dataclasses import asdict, dataclass
from itertools import count
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from f8train.checkpoint_manifest import (
    FORMAT,  # noqa: F401  (importable from here as well)
    MANIFEST,
    read_manifest,  # noqa: F401  (importable from here as well)
    verify,  # noqa: F401  (importable from here as well)
    write_manifest,
)
from f8train.dcp_safe import SafeFileSystemReader, WeightsOnlyLoadPlanner
from f8train.process_group import all_gather_object, broadcast_from_0
from f8train.train_log import fmt_bytes

SET_ASIDE = "set_aside"
_STEP_DIR = re.compile(r"step_(\d+)")
_SPACE_MARGIN = 1.10  # beyond the estimated size of a checkpoint (metadata, the manifest)


def warn(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def step_of(path: Path) -> int:
    match = _STEP_DIR.fullmatch(Path(path).name)
    return int(match.group(1)) if match else -1


def aside_name(path: Path, suffix: str) -> Path:
    """``step_N.suffix``, or ``step_N.suffix2``, ... : a name nothing uses yet."""
    names = (path.with_name(f"{path.name}.{suffix}{n if n > 1 else ''}") for n in count(1))
    return next(new for new in names if not new.exists())


def dcp_problem(path: Path) -> str | None:
    """Why the folder ``path`` is not a finished DCP save, from its file names alone (None:
    it has ``.metadata`` and a ``.distcp`` data file). Nothing is opened: ``.metadata`` is a
    pickle, read only from a checkpoint verified against its manifest."""
    if not (Path(path) / ".metadata").is_file():
        return "no .metadata (DCP's save did not finish)"
    if not any(p.is_file() for p in Path(path).glob("*.distcp")):
        return "no .distcp data file (DCP's save did not finish)"
    return None


def free_bytes(path: Path) -> int:
    """Free bytes on the file system of ``path`` (its nearest existing parent)."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    return shutil.disk_usage(existing).free


@dataclass
class ModelOptimizerState(Stateful):
    """Model + optimizer through DCP's state-dict helpers (FQNs without wrapper prefixes)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer

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


@dataclass
class SchedulerState(Stateful):
    """An LR scheduler's counters, without ``lr_lambdas`` (rebuilt from the flags)."""

    scheduler: torch.optim.lr_scheduler.LRScheduler

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.__dict__.update(state_dict)


class RNGState(Stateful):
    """The torch RNG states (CPU, and the current CUDA device's); the same on all ranks,
    since every rank seeds the same, so a resharded resume restores them too."""

    def state_dict(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["cpu"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])


@dataclass
class ProgressState(Stateful):
    """Where the run is: the last completed step and the tokens trained on so far."""

    step: int = 0
    tokens: int = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.tokens = int(state_dict["step"]), int(state_dict["tokens"])


class Checkpointer:
    """Save/load/find the DCP checkpoints under ``root``; ``keep`` newest are kept."""

    def __init__(self, root: Path, *, keep: int, is_main: bool) -> None:
        self.root, self.keep, self.is_main = Path(root), keep, is_main

    @staticmethod
    def is_complete(path: Path) -> bool:
        return (Path(path) / MANIFEST).is_file()

    def step_dirs(self) -> list[Path]:
        """Folders named like a checkpoint (``step_N``), complete or not, oldest first."""
        found = [p for p in self.root.glob("step_*") if p.is_dir() and _STEP_DIR.fullmatch(p.name)]
        return sorted(found, key=step_of)

    def complete(self) -> list[Path]:
        """Complete checkpoints (those with a manifest), oldest first."""
        return [p for p in self.step_dirs() if self.is_complete(p)]

    def latest(self) -> Path | None:
        return next(reversed(self.complete()), None)

    def may_load(self, path: Path) -> bool:
        """Complete, or without a manifest but with DCP's files (in doubt: kept, never
        loaded)."""
        return self.is_complete(path) or dcp_problem(path) is None

    def path_for(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def save(self, step: int, state: dict[str, Stateful], settings: dict[str, Any]) -> Path:
        """DCP save, then the manifest of checksums (collective: every rank calls it)."""
        path = self.path_for(step)
        need = self.check_space(step, state)
        if self.is_main and path.exists():
            self._clear(path)
        dist.barrier()
        try:
            dcp.save(state, checkpoint_id=path)
        except (Exception, CheckpointException) as err:  # CheckpointException: BaseException
            if free_bytes(self.root) < need or "No space left" in str(err):
                why = f"the save failed: {_first_lines(err)}"
                raise SystemExit(self._no_space(step, need, why)) from None
            cause = write_failure(err)
            if cause is None:
                raise
            raise SystemExit(self._write_failed(step, cause, err)) from None
        dist.barrier()  # every rank's files are written
        write_manifest(path, step=step, settings=settings)
        dist.barrier()  # the manifest is in place before anyone prunes or reads it
        if self.is_main:
            self._prune()
        return path

    def check_space(self, step: int | None, state: dict[str, Stateful] | None = None) -> int:
        """Stop every rank, with rank 0's verdict, when the disk lacks room for the next
        checkpoint: the newest one's size, else the state's tensor bytes over all ranks
        (collective). Returns the bytes needed."""
        latest = broadcast_from_0(self.latest() if self.is_main else None)
        if latest is not None:
            need = sum(p.stat().st_size for p in Path(latest).rglob("*") if p.is_file())
        else:
            need = sum(all_gather_object(_tensor_bytes(state))) if state is not None else 0
        need = int(need * _SPACE_MARGIN)
        problem = None
        if self.is_main and free_bytes(self.root) < need:
            problem = self._no_space(step, need, "checked before the save")
        need, problem = broadcast_from_0((need, problem))
        if problem is not None:
            raise SystemExit(problem)
        return need

    def _no_space(self, step: int | None, need: int, when: str) -> str:
        what = f"checkpoint step {step}" if step is not None else "this run's checkpoints"
        latest = self.latest()
        resume = f"rerun the same command to resume from {latest}" if latest else "rerun"
        return (
            f"No space left on device for {what} under {self.root} ({when}): "
            f"{fmt_bytes(free_bytes(self.root))} free, about {fmt_bytes(need)} needed (the "
            f"last checkpoint's size). Free space on that disk (or lower --keep-ckpts, or "
            f"choose another --out), then {resume}. No checkpoint was deleted."
        )

    def _write_failed(self, step: int, cause: str, err: BaseException) -> str:
        latest = self.latest()
        resume = f"rerun the same command to resume from {latest}" if latest else "rerun"
        return (
            f"could not write checkpoint step {step} under {self.root}: {cause} "
            f"({'; '.join(_error_lines(err))}). {resume.capitalize()} once it is fixed. "
            "No checkpoint was deleted."
        )

    def _clear(self, path: Path) -> None:
        """Make room for a save at ``path``: a folder with a manifest or DCP's files is
        renamed aside (never deleted); an interrupted save, without them, is removed."""
        if self.may_load(path):
            new = aside_name(path, SET_ASIDE)
            path.rename(new)
            warn(
                f"WARNING: {path} was in the way of this save and may load; renamed it to "
                f"{new} (kept; delete it when done)"
            )
        else:
            shutil.rmtree(path)

    def load(self, path: Path, state: dict[str, Stateful]) -> None:
        """DCP load of a verified checkpoint; a failure names the checkpoint and exits."""
        checked = f"could not load checkpoint {path}, although its files match their checksums"
        reader = SafeFileSystemReader(path)
        try:
            reader.read_metadata()  # a refusal stops here, before DCP's retries and logs
        except ValueError as err:
            raise SystemExit(f"{checked}: {err}") from None
        try:
            dcp.load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner())
        except (CheckpointException, RuntimeError, KeyError, ValueError) as err:
            raise SystemExit(
                f"{checked}: {'; '.join(_error_lines(err))}\nresume with the flags it was "
                f"saved with (see the run.json next to it), or use another --out"
            ) from None

    def _prune(self) -> None:
        """Complete checkpoints beyond the newest ``keep``, and interrupted saves older than
        the newest; never a folder without a manifest that holds DCP's files."""
        complete = self.complete()
        newest = step_of(complete[-1]) if complete else -1
        for old in complete[: max(0, len(complete) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)
        for partial in self.step_dirs():
            if step_of(partial) < newest and not self.may_load(partial):
                shutil.rmtree(partial, ignore_errors=True)


def _tensor_bytes(state: dict[str, Stateful]) -> int:
    """Bytes of this rank's tensors in the state (a DTensor's local shard)."""
    leaves = tree_leaves([s.state_dict() for s in state.values()])
    local = [t.to_local() if isinstance(t, DTensor) else t for t in leaves]
    return sum(t.numel() * t.element_size() for t in local if isinstance(t, torch.Tensor))


def write_failure(err: BaseException) -> str | None:
    """Why a save's files could not be written in full, with the remedy, or None when the
    error is not a failed write: a file-size limit (``ulimit -f``, which makes writes fail
    with EFBIG once SIGXFSZ is ignored) or another short write (torch.save's zip writer
    reports it as ``unexpected pos``)."""
    text = str(err)
    efbig = "File too large" in text or f"[Errno {errno.EFBIG}]" in text
    if not (efbig or "unexpected pos" in text):
        return None
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        return (
            f"a file reached this process's file-size limit ({fmt_bytes(limit)}, ulimit -f): "
            "raise it (ulimit -f unlimited, or the job scheduler's file-size limit)"
        )
    if efbig:
        return "a file is larger than the file system under --out allows: choose another --out"
    return (
        "a file was written short (the file system refused part of a write: a quota, a "
        "file-size limit or a failing disk): check the disk and quotas under --out"
    )


def _error_lines(err: BaseException) -> list[str]:
    """The ``SomeError: ...`` lines of an error's text (DCP carries each rank's traceback
    in its message), once each; the first line when there are none."""
    lines = [line.strip() for line in str(err).splitlines()]
    found = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    return list(dict.fromkeys(found)) or lines[:1]


def _first_lines(err: BaseException, n: int = 6) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return "\n".join(lines[:n]) + ("\n..." if len(lines) > n else "")
