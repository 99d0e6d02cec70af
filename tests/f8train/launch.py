"""Launch the real ``torchrun ... -m f8train.train`` from tests, with a tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# dim 64, 2 layers, seq 32: every block linear is a multiple of 16, so all 14 convert
TINY = [
    *("--dim", "64", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2"),
    *("--multiple-of", "16", "--seq-len", "32", "--global-batch", "8", "--val-batches", "2"),
]


def torchrun_command(nproc: int, *torchrun_args: str) -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--standalone", "--nproc_per_node", str(nproc), *torchrun_args]


def train(
    out: Path,
    *args: str,
    nproc: int = 2,
    torchrun_args: tuple[str, ...] = (),
    timeout: float = 180,
) -> subprocess.CompletedProcess:
    """Run f8train.train with the tiny model into ``out``; returns the finished process."""
    command = [
        *torchrun_command(nproc, *torchrun_args),
        *("-m", "f8train.train", *TINY, "--out", str(out), *args),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "RANK"))}
    return subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def output_of(result: subprocess.CompletedProcess) -> str:
    return f"exit code {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr[-6000:]}"


def metrics(out: Path) -> list[dict]:
    path = Path(out) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_info(out: Path) -> dict:
    return json.loads((Path(out) / "run.json").read_text())
