"""How a run of ``f8train/train.py`` is controlled from outside: one job per ``--out`` (the
lock ``OUT/.lock``), a graceful stop on SIGTERM/SIGINT, and the test hooks that crash or
hang a rank. Two jobs in one ``--out`` would corrupt each other's checkpoints and metrics,
and the symptom (a checkpoint that does not load) would point at the wrong cause.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

LOCK = ".lock"


def _owner(path: Path) -> dict:
    """The lock's owner: host, pid and start time (empty when unreadable)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _well_formed(owner: object) -> bool:
    """A lock as ``acquire_lock`` writes it: a string host, an integer pid, a finite start
    time."""
    if not isinstance(owner, dict) or not {"host", "pid", "started"} <= owner.keys():
        return False
    host, pid, started = owner["host"], owner["pid"], owner["started"]
    number = isinstance(started, int | float) and not isinstance(started, bool)
    return (
        isinstance(host, str)
        and isinstance(pid, int)
        and not isinstance(pid, bool)
        and pid > 0
        and number
        and 0 <= started < 2**40  # seconds since 1970: time.gmtime takes it
    )


def _owner_text(owner: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(owner.get("started", 0)))
    return f"pid {owner.get('pid')} on host {owner.get('host')}, started {started}"


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # runs, as another user
        pass
    return True


def acquire_lock(out: Path) -> str | None:
    """Take ``out``'s lock for this process; returns why it cannot (None: taken). A lock
    left by a dead job on this host is taken over, saying so; one from another host cannot
    be checked, so the message says how to remove it."""
    path = Path(out) / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    for _ in range(2):  # a second try after removing a stale lock
        try:
            with path.open("x") as f:
                json.dump(me, f)
            return None
        except FileExistsError:
            owner = _owner(path)
        if not _well_formed(owner):
            return (
                f"--out {out}: the lock file {path} is empty or unreadable (expected JSON "
                "with a string host, an integer pid and a number started), so the job that "
                "made it cannot be told: one that is starting now writes it within a "
                "moment, one killed while writing it left it so. If no job is using "
                f"--out {out}, delete {path} and rerun."
            )
        if owner["host"] != me["host"] or _pid_runs(int(owner["pid"])):
            return (
                f"--out {out} is in use by another job ({_owner_text(owner)}; lock file "
                f"{path}). Two jobs in one --out would overwrite each other's checkpoints "
                f"and metrics: wait for that job to end, or use another --out. If that job "
                f"is not running any more, delete {path} and rerun."
            )
        print(
            f"note: removing the stale lock {path} of a job that no longer runs "
            f"({_owner_text(owner)})",
            file=sys.stderr,
            flush=True,
        )
        path.unlink(missing_ok=True)
    return f"could not take the lock {path}: it reappeared after removing a stale one"


def release_lock(out: Path) -> None:
    """Remove the lock if this process holds it."""
    path = Path(out) / LOCK
    owner = _owner(path)
    if (
        _well_formed(owner)
        and owner["pid"] == os.getpid()
        and owner.get("host") == socket.gethostname()
    ):
        path.unlink(missing_ok=True)


class GracefulStop:
    """SIGTERM/SIGINT set a flag the loop checks once per step (all ranks agree through the
    per-step all-reduce), so the run saves a checkpoint and exits 0. A second signal falls
    back to the previous handler."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None
        self._previous = {
            sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)
        }

    def _handle(self, signum: int, frame) -> None:
        if self.requested:  # second signal: stop now
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            os.kill(os.getpid(), signum)
            return
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def __enter__(self) -> GracefulStop:
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def fault_hooks(step: int, args, rank: int, world: int) -> None:
    """After step K the last rank, with ``--crash-at-step K``, exits abruptly, the first time
    only (a marker file in ``--out``), so ``torchrun --max-restarts 1`` resumes; with
    ``--hang-at-step K`` it waits in a receive no rank sends, a hung job that
    ``--pg-timeout-s`` must end with a message."""
    if rank != world - 1:
        return
    marker = Path(args.out) / f".crashed_at_step_{step}"
    if step == args.crash_at_step and not marker.exists():
        marker.touch()
        print(f"[rank {rank}] --crash-at-step {step}: exiting abruptly (test hook)", flush=True)
        sys.stderr.flush()
        os._exit(17)
    if step == args.hang_at_step and world > 1:
        print(f"[rank {rank}] --hang-at-step {step}: waiting for a message never sent", flush=True)
        dist.recv(torch.zeros(1), src=0)
