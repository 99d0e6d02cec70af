"""How a launched rank ends (``f8train.rank_exit.exit_rank``) and what it prints when it
dies in C++ (``enable_crash_traces``), checked in child processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from f8train import rank_exit

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


def _launch(*args: str, tmp_path: Path) -> tuple[int, str]:
    from tests.f8train.launch import torchrun_command

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "RANK"))}
    command = [*torchrun_command(2), "-m", "f8train.train", "--out", str(tmp_path / "run"), *args]
    result = subprocess.run(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=180,
    )
    return result.returncode, result.stdout


def _last_words(output: str) -> str:
    """The last non-empty line that is not the closing border of torchrun's failure box."""
    lines = [line.strip() for line in output.splitlines()]
    return [line for line in lines if line and set(line) != {"="}][-1]


def test_an_argument_error_under_torchrun_is_printed_once_and_last(tmp_path: Path) -> None:
    """A wrong flag on 2 torchrun ranks: the usage and the error once (rank 0), and the
    error is the last words of the output (the root cause line of torchrun's summary)."""
    code, output = _launch("--recipe", "nope", tmp_path=tmp_path)
    assert code != 0, output
    assert output.count("usage:") == 1, output
    assert "invalid choice: 'nope'" in _last_words(output), output
    assert "Signal 15" not in output.split("Root Cause")[-1], output  # rank 0 is the cause


def _as_torchrun_rank(monkeypatch, rank: int, tmp_path: Path) -> Path:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"error{rank}.json"))
    monkeypatch.setattr(rank_exit, "PEER_WAIT_S", 0.0)  # torchrun would end rank 1 here
    return tmp_path / f"error{rank}.json"


@pytest.mark.parametrize("rank", [0, 1])
def test_argument_time_under_torchrun_speaks_on_rank_0(rank, monkeypatch, capsys, tmp_path):
    """In-process: the help and an argparse error on rank 0 as without torchrun, plus the
    error file torchrun's summary shows; rank 1 silent on --help, and a refusal it still
    meets after the wait (rank 0 did not end the job: the ranks disagree) names its rank."""
    from f8train import train

    error_file = _as_torchrun_rank(monkeypatch, rank, tmp_path)
    with pytest.raises(SystemExit) as stop:
        train.main(["--help"])
    assert stop.value.code == 0
    assert ("usage:" in capsys.readouterr().out) == (rank == 0)
    with pytest.raises(SystemExit) as stop:
        train.main(["--recipe", "nope"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("invalid choice: 'nope'") == 1 and err.count("usage:") == 1, err
    assert err.startswith("rank 1: ") == (rank == 1), err
    message = json.loads(error_file.read_text())["message"]["message"]
    assert message.startswith("torchrun --standalone") and "'nope'" in message, message
    with pytest.raises(SystemExit) as stop:  # a refusal raised as SystemExit(text)
        train.main(["--recipe", "rowwise", "--scaling", "delayed"])
    assert stop.value.code == 1
    assert "delayed and static scaling are tensorwise only" in capsys.readouterr().err


def test_argument_time_outside_torchrun_keeps_the_exit(monkeypatch) -> None:
    from f8train import train

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(SystemExit, match="delayed and static scaling are tensorwise only"):
        train.main(["--recipe", "rowwise", "--scaling", "delayed"])
