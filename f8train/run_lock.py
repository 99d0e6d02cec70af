"""One job per ``--out``: a lock file ``OUT/.lock`` holding the owner's host, pid and start.

Mental model: two jobs writing the same checkpoints and ``metrics.jsonl`` would corrupt each
other (one saves while the other loads or prunes), and the symptom, a checkpoint that fails
to load, would point at the wrong cause. Rank 0 creates the lock with ``O_EXCL`` before
anything in ``--out`` is read or written; every rank gets its verdict, so all ranks stop
together with the owner named. A lock left by a job that died on this host (its pid no
longer runs) is taken over, saying so; one from another host cannot be checked from here,
so the message says how to remove it once that job is known to be gone.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

LOCK = ".lock"


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # runs, as another user
        return True
    return True


def _owner_text(owner: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(owner.get("started", 0)))
    return f"pid {owner.get('pid')} on host {owner.get('host')}, started {started}"


def acquire(out: Path) -> str | None:
    """Take ``out``'s lock for this process; returns why it cannot (None: taken)."""
    path = Path(out) / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    for _ in range(2):  # a second try after removing a stale lock
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                owner = json.loads(path.read_text())
            except (OSError, ValueError):
                owner = {}
            if owner.get("host") == me["host"] and not _pid_runs(int(owner.get("pid", -1))):
                print(
                    f"note: removing the stale lock {path} of a job that no longer runs "
                    f"({_owner_text(owner)})",
                    file=sys.stderr,
                    flush=True,
                )
                path.unlink(missing_ok=True)
                continue
            return (
                f"--out {out} is in use by another job ({_owner_text(owner)}; lock file "
                f"{path}). Two jobs in one --out would overwrite each other's checkpoints "
                f"and metrics: wait for that job to end, or use another --out. If that job "
                f"is not running any more, delete {path} and rerun."
            )
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return None
    return f"could not take the lock {path}: it reappeared after removing a stale one"


def release(out: Path) -> None:
    """Remove the lock if this process holds it."""
    path = Path(out) / LOCK
    try:
        owner = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)
