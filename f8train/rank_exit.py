"""How a launched rank ends: crash traces while it runs, a flushed ``os._exit`` after it.
Both are process-wide, so only a script's ``__main__`` entry turns them on."""

from __future__ import annotations

import faulthandler
import os
import sys
from typing import NoReturn


def enable_crash_traces() -> None:
    """On SIGSEGV/SIGABRT/SIGBUS/SIGFPE print every Python thread's stack to stderr, so a
    rank that dies in C++ (a collective, a kernel, teardown) says where it was."""
    if sys.__stderr__ is not None:  # the process's own stderr, not a test's capture of it
        faulthandler.enable(file=sys.__stderr__, all_threads=True)


def exit_rank(code: int) -> NoReturn:
    """After ``dist.destroy_process_group()``: flush stdout and stderr, then ``os._exit``,
    skipping Python's finalization, where a c10d worker thread still freeing tensors can
    abort a finished run (docs/trainer.md). Callers close every file they write first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
