"""The cluster launchers in scripts/ run the trainer with the flags they are given.

Each launcher prints the command it runs (DRY_RUN=1: only prints it). The default lane
checks the printed commands (one node, multi-node with a c10d or a static rendezvous,
SLURM with its environment faked) and runs each training launcher once as a real 2-process
CPU job (DEVICE=cpu, NGPU=2) of the trainer's `--help`, which goes through torchrun's
rendezvous and the flag pass-through; the slow lane trains 2 steps of a tiny model through
each. The GPU benchmark wrapper runs f8train/gpu_bench.sh's dry run.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.f8train.launch import REPO, TINY, metrics

SCRIPTS = REPO / "scripts"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(script: str, *flags: str, timeout: float = 120, **env: str):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "RANK"))}
    base.update({"PYTHON": sys.executable, "DEVICE": "cpu", "NGPU": "2", **env})
    return subprocess.run(
        ["bash", str(SCRIPTS / script), *flags],
        cwd="/",  # the launchers find the repository themselves
        env=base,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _printed(result) -> list[str]:
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("+ "))
    return shlex.split(line[2:])


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


SLURM_ENV = {"SLURM_NNODES": "1", "SLURM_JOB_ID": "4242", "MASTER_ADDR": "127.0.0.1"}
# script, environment (besides DEVICE=cpu, NGPU=2): what a real 2-process run needs
LAUNCHERS = {
    "train_single_node.sh": {},
    "train_multi_node.sh": {"NNODES": "1", "MASTER_ADDR": "127.0.0.1"},
    "train_slurm.sbatch": {**SLURM_ENV, "SRUN": ""},
}


def test_dry_runs_print_the_torchrun_command() -> None:
    flags = ("--preset", "tiny", "--out", "runs/a b")
    one = _printed(_run("train_single_node.sh", *flags, DRY_RUN="1", NGPU="8", DEVICE="cuda"))
    assert one[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert _after(one, "--nproc_per_node") == "8" and _after(one, "--device") == "cuda"
    assert one[one.index("f8train.train") + 3 :] == list(flags)  # after --device cuda
    env = {"DRY_RUN": "1", "NNODES": "4", "MASTER_ADDR": "node0", "MASTER_PORT": "1234"}
    c10d = _printed(_run("train_multi_node.sh", *flags, **env))
    assert _after(c10d, "--nnodes") == "4" and _after(c10d, "--rdzv_backend") == "c10d"
    assert _after(c10d, "--rdzv_endpoint") == "node0:1234" and c10d[-4:] == list(flags)
    static = _printed(_run("train_multi_node.sh", **env, NODE_RANK="3"))
    assert _after(static, "--node_rank") == "3" and _after(static, "--master_addr") == "node0"
    slurm = _printed(_run("train_slurm.sbatch", *flags, **SLURM_ENV, DRY_RUN="1"))
    assert slurm[0] == "srun" and _after(slurm, "--rdzv_id") == "4242"
    assert _after(slurm, "--rdzv_endpoint") == "127.0.0.1:29500" and slurm[-4:] == list(flags)


def test_launchers_refuse_bad_settings_naming_them() -> None:
    bad = _run("train_single_node.sh", NGPU="eight")
    assert bad.returncode == 2 and "NGPU=eight is not a positive integer" in bad.stderr
    no_nodes = _run("train_multi_node.sh", DRY_RUN="1")
    assert no_nodes.returncode != 0 and "set NNODES" in no_nodes.stderr
    no_slurm = _run("train_slurm.sbatch", DRY_RUN="1")
    assert no_slurm.returncode != 0 and "not under SLURM" in no_slurm.stderr


@pytest.mark.parametrize("word", ["1", "yes", "TRUE", "on", "y"])
def test_dry_run_takes_the_usual_words_for_yes(word: str) -> None:
    # --steps 0 is refused by the trainer: a run would fail
    result = _run("train_single_node.sh", "--steps", "0", DRY_RUN=word)
    assert result.returncode == 0 and _printed(result)[-2:] == ["--steps", "0"], result.stderr
    assert "usage:" not in result.stdout + result.stderr  # nothing ran


@pytest.mark.parametrize("word", ["no", "False"])
def test_dry_run_takes_the_usual_words_for_no(word: str) -> None:
    result = _run("train_single_node.sh", "--help", DRY_RUN=word, NGPU="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage: torchrun" in result.stdout  # the trainer ran


def test_dry_run_refuses_other_words_naming_them() -> None:
    result = _run("train_single_node.sh", "--help", DRY_RUN="maybe")
    assert result.returncode == 2 and "usage:" not in result.stdout, result.stdout
    assert "DRY_RUN=maybe is neither yes nor no" in result.stderr, result.stderr
    assert "DRY_RUN=1" in result.stderr and "DRY_RUN=0" in result.stderr


@pytest.mark.parametrize("node_rank", ["5", "2", "-1", "one"])
def test_multi_node_refuses_a_node_rank_outside_the_job(node_rank: str) -> None:
    env = {"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "NODE_RANK": node_rank}
    result = _run("train_multi_node.sh", DRY_RUN="1", **env)
    assert result.returncode == 2 and not result.stdout, result.stdout
    assert f"NODE_RANK={node_rank} is not a node of the job" in result.stderr, result.stderr
    assert "0 .. 1 with NNODES=2" in result.stderr


def test_slurm_launcher_outside_an_allocation_says_so() -> None:
    env = {"SLURM_NNODES": "1", "SLURM_JOB_ID": "4242", "PATH": "/usr/bin:/bin"}
    result = _run("train_slurm.sbatch", DRY_RUN="1", **env)
    assert result.returncode == 2 and not result.stdout, result.stdout
    assert "command not found" not in result.stderr, result.stderr
    assert "inside a SLURM allocation" in result.stderr and "MASTER_ADDR" in result.stderr


@pytest.mark.parametrize("script", sorted(LAUNCHERS))
def test_two_process_cpu_run_passes_the_flags_through(script: str) -> None:
    result = _run(script, "--help", MASTER_PORT=str(_free_port()), **LAUNCHERS[script])
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "usage: torchrun --standalone --nproc_per_node N -m f8train.train" in result.stdout


def test_gpu_bench_wrapper_dry_run() -> None:
    result = _run("gpu_bench.sh", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "step train_float8" in result.stdout and "total 360 s worst case" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(LAUNCHERS))
def test_two_process_cpu_training_run(script: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**LAUNCHERS[script], "MASTER_PORT": str(_free_port())}
    result = _run(script, *TINY, "--steps", "2", "--out", str(out), timeout=300, **env)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert [m["step"] for m in metrics(out) if "loss" in m][-1] == 2
