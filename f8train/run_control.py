"""Run control of ``f8train/train.py``: the graceful stop on SIGTERM/SIGINT and the test
hooks that crash or hang a rank (hidden flags ``--crash-at-step`` and ``--hang-at-step``).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


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


def maybe_hang(step: int, hang_at_step: int | None, rank: int, world: int) -> None:
    """Test hook (``--hang-at-step K``): after step K the last rank waits in a receive that
    no rank sends, so the others block in the next step's collectives: a hung job, which
    ``--pg-timeout-s`` must end with a message."""
    if hang_at_step is None or step != hang_at_step or rank != world - 1 or world == 1:
        return
    print(f"[rank {rank}] --hang-at-step {step}: waiting for a message never sent", flush=True)
    dist.recv(torch.zeros(1), src=0)
