"""How a launched rank ends: crash traces while it runs, a flushed ``os._exit`` after it.
Both are process-wide, so only a script's ``__main__`` entry turns them on.

Argument-time refusals (``argument_time``) under torchrun: every rank parses the same
command line, so without care each prints the usage and the error, and torchrun's failure
summary then buries them. Rank 0 alone prints them and hands the error to torchrun as its
error file, so the summary, which torchrun prints last, names it as the root cause; the
other ranks stay silent and wait to be ended by torchrun.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import NoReturn

# how long a rank other than 0 waits, after a refusal, for torchrun to end it (rank 0 meets
# the same refusal); past it the ranks disagree, and it prints its own message
PEER_WAIT_S = 30.0


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


def _launched_rank() -> int | None:
    """This process's global rank when torchrun started it, else None."""
    return int(os.environ.get("RANK", "0")) if "TORCHELASTIC_RUN_ID" in os.environ else None


@contextlib.contextmanager
def argument_time() -> Iterator[None]:
    """Run argument parsing and checks: outside torchrun as they are; under torchrun, a
    ``SystemExit`` (argparse's usage and error, ``--help``, a refusal's message) is printed
    by rank 0 only, with the same exit code on every rank (see the module docstring)."""
    rank = _launched_rank()
    if rank is None:
        yield
        return
    err, out = io.StringIO(), io.StringIO()
    quiet = contextlib.redirect_stdout(out) if rank else contextlib.nullcontext()
    try:
        with contextlib.redirect_stderr(err), quiet:
            yield
    except SystemExit as stop:
        said = isinstance(stop.code, int) or stop.code is None  # else SystemExit(message)
        code = (stop.code or 0) if said else 1
        text = err.getvalue() + ("" if said else f"{stop.code}\n")
        if rank != 0:
            if code == 0:  # --help: rank 0 printed it
                raise SystemExit(0) from None
            time.sleep(PEER_WAIT_S)  # torchrun ends this rank once rank 0 has failed
            text = f"rank {rank}: {text}"
        sys.stderr.write(text)
        if code != 0:
            _error_file(text)
        raise SystemExit(code) from None
    sys.stderr.write(err.getvalue())
    sys.stdout.write(out.getvalue())


def _error_file(text: str) -> None:
    """Give torchrun the refusal (from argparse's ``error:`` line on) as this rank's error
    file: its failure summary shows it as the root cause's last line."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    lines = text.rstrip().splitlines()
    start = max((i for i, line in enumerate(lines) if ": error: " in line), default=0)
    message = "\n".join(lines[start:])
    record = {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}
    with open(path, "w") as f:
        json.dump({"message": record}, f)
