"""How a launched rank ends (``f8train.rank_exit.exit_rank``) and what it prints when it
dies in C++ (``enable_crash_traces``), checked in child processes."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_exit_rank_flushes_buffered_output_and_keeps_the_code() -> None:
    # stdout is a pipe here, so it is block-buffered: os._exit alone would drop these lines
    result = run_child(
        "import sys\n"
        "from f8train.rank_exit import exit_rank\n"
        "print('summary line', end='')\n"
        "sys.stderr.write('warning line')\n"
        "exit_rank(7)\n"
        "print('never')\n"
    )
    assert result.returncode == 7, result.stderr
    assert result.stdout == "summary line"
    assert result.stderr.endswith("warning line")


def test_crash_traces_name_the_python_frame_of_an_abort() -> None:
    result = run_child(
        "import os\n"
        "from f8train.rank_exit import enable_crash_traces\n"
        "def teardown_step():\n"
        "    os.abort()\n"
        "enable_crash_traces()\n"
        "teardown_step()\n"
    )
    assert result.returncode == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in result.stderr, result.stderr
    assert "teardown_step" in result.stderr, result.stderr
