"""How a launched rank ends: crash traces while it runs, a flushed ``os._exit`` after it.

Both are process-wide, so the ``__main__`` entry of a script turns them on, never a
function that an in-process caller (a test) might run.
"""

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
    """End a launched rank after ``dist.destroy_process_group()``: flush stdout and stderr,
    then ``os._exit(code)``, skipping interpreter finalization.

    Why: destroying the process group unregisters it, but FSDP state, the device mesh and
    reference cycles keep the C++ process group alive, and its worker threads (gloo's
    runLoop, NCCL's watchdog) may still be dropping their last collectives' tensors when the
    main thread returns. Freeing a tensor whose Python object C++ kept alive needs the GIL;
    a thread that asks for the GIL while Python finalizes is ended with ``pthread_exit``,
    which aborts from a destructor ("terminate called without an active exception",
    SIGABRT). torchrun then reports the finished run as failed (and with ``--max-restarts``
    restarts it). CI saw this once on rank 1 of a 2-step CPU run after every output was
    written. The callers close every file they write before this point (metrics are
    appended with a ``with`` block per line), so nothing is lost by skipping finalization.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
