"""The trainer's own files lose nothing: ``metrics.jsonl`` lines a run trains again are
moved, not truncated, and a second job on the same ``--out`` is refused by its lock."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from f8train import run_control
from f8train.train_log import MetricsFile


def _write(path: Path, steps: list[int]) -> list[str]:
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in steps]
    path.write_text("".join(line + "\n" for line in lines))
    return lines


def test_metrics_of_steps_trained_again_are_moved_not_truncated(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = _write(path, [1, 2, 3, 4])
    resumed = MetricsFile(path, enabled=True, resume_step=2)  # resumed from step 2
    assert resumed.dropped == 2
    assert path.read_text().splitlines() == lines[:2]
    assert resumed.dropped_path.read_text().splitlines() == lines[2:]
    fresh = MetricsFile(path, enabled=True, resume_step=0)  # a fresh start in the same --out
    assert fresh.dropped == 2 and path.read_text() == ""
    assert resumed.dropped_path.read_text().splitlines() == lines[2:] + lines[:2]  # appended


def test_second_job_on_the_same_out_is_refused(tmp_path: Path) -> None:
    assert run_control.acquire_lock(tmp_path) is None
    why = run_control.acquire_lock(tmp_path)  # a second job (here: the same live pid)
    assert why is not None and "is in use by another job" in why, why
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in why
    assert "use another --out" in why and str(tmp_path / run_control.LOCK) in why
    run_control.release_lock(tmp_path)
    assert not (tmp_path / run_control.LOCK).exists()


def test_lock_of_a_dead_job_is_taken_over(tmp_path: Path, capsys) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    owner = {"host": socket.gethostname(), "pid": int(dead.stdout), "started": 0}
    (tmp_path / run_control.LOCK).write_text(json.dumps(owner))
    assert run_control.acquire_lock(tmp_path) is None
    assert "removing the stale lock" in capsys.readouterr().err
    assert json.loads((tmp_path / run_control.LOCK).read_text())["pid"] == os.getpid()
    run_control.release_lock(tmp_path)


def test_compare_keeps_an_earlier_run_in_the_way(tmp_path: Path, monkeypatch) -> None:
    """compare.py used to rmtree a configuration's folder (checkpoints included) when the
    run was not reusable; now it renames it aside."""
    from f8train import compare

    old = tmp_path / "bf16" / "checkpoints" / "step_00000004" / ".metadata"
    old.parent.mkdir(parents=True)
    old.write_bytes(b"a checkpoint")
    failed = subprocess.CompletedProcess([], returncode=1)
    monkeypatch.setattr(compare.subprocess, "run", lambda *a, **k: failed)
    args, train_args = compare.parse_args(["--out", str(tmp_path), "--steps", "2"])
    assert compare.run_config("bf16", args, train_args) == {"name": "bf16", "failed": 1}
    kept = tmp_path / "bf16.previous" / "checkpoints" / "step_00000004" / ".metadata"
    assert kept.read_bytes() == b"a checkpoint"
