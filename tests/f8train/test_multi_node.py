"""A 2-node job on localhost: two torchrun agents (``--nnodes 2 --node_rank 0/1``, one rank
each, a static rendezvous) that differ the way two nodes' commands can.

- Other ``--steps`` on each node: the ranks compare their flags right after the process
  group starts and all stop, naming the flag and the ranks holding each value.
- ``--steps 0`` on node 1 only, which it refuses at argument time: node 0 ends after
  ``--pg-timeout-s``, saying that a rank never joined and where to look.
- Another ``--out`` on each node (no shared file system): the ranks stop at start-up,
  naming ``--out`` and the rank that cannot see rank 0's file, before anything is saved.
- Another ``--data`` corpus on each node: the ranks stop before building the model, naming
  ``--data`` and the token counts.
- The same command with a shared ``--out``: trains (the checks pass what must pass).
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from tests.f8train.launch import REPO, TINY, torchrun_command

TIMEOUT_S = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(per_node: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Both agents at once, node i with ``per_node[i]`` after the tiny model's flags."""
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "RANK"))}
    procs = []
    for node, flags in enumerate(per_node):
        command = torchrun_command(1)
        command.remove("--standalone")
        command += ["--nnodes", "2", "--node_rank", str(node)]
        command += ["--master_addr", "127.0.0.1", "--master_port", port]
        command += ["-m", "f8train.train", *TINY, "--val-every", "0", *flags]
        procs.append(
            subprocess.Popen(
                command,
                cwd=REPO,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=TIMEOUT_S)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def _said(results: list[subprocess.CompletedProcess]) -> str:
    return "\n".join(
        f"--- node {i} rc {r.returncode}\n{r.stderr[-4000:]}" for i, r in enumerate(results)
    )


def test_nodes_with_other_flags_stop_naming_the_flag(tmp_path: Path) -> None:
    out = ["--out", str(tmp_path / "run")]
    results = _two_nodes([[*out, "--steps", "2"], [*out, "--steps", "3"]])
    said = _said(results)
    assert all(r.returncode != 0 for r in results), said
    for r in results:
        assert "the ranks were started with different flags" in r.stderr, said
        assert "--steps: rank 0 2, rank 1 3" in r.stderr, said
    assert "SIGABRT" not in said and 'f8train/train.py", line' not in said  # no traceback
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # stopped before step 1


@pytest.mark.slow  # node 1 waits 30 s for torchrun to end it (f8train/rank_exit.py)
def test_a_node_that_refuses_its_flags_ends_the_other_with_a_message(tmp_path: Path) -> None:
    """Node 1 refuses --steps 0 at argument time; node 0 waits --pg-timeout-s for it in the
    process group's start and then says what it waited for, without a traceback."""
    out = ["--out", str(tmp_path / "run"), "--pg-timeout-s", "5"]
    results = _two_nodes([[*out, "--steps", "2"], [*out, "--steps", "0"]])
    said = _said(results)
    assert all(r.returncode != 0 for r in results), said
    assert "argument --steps: expected an integer >= 1, got '0'" in results[1].stderr, said
    text = "rank 0: the process group did not form within --pg-timeout-s 5 s"
    assert text in results[0].stderr and "another rank never joined" in results[0].stderr, said
    assert 'f8train/train.py", line' not in said  # no traceback


def test_nodes_with_their_own_out_stop_naming_it(tmp_path: Path) -> None:
    outs = [tmp_path / "node0", tmp_path / "node1"]
    results = _two_nodes([["--out", str(o), "--steps", "1"] for o in outs])
    said = _said(results)
    assert all(r.returncode != 0 for r in results), said
    text = f"--out {outs[1]} is not one folder shared by all ranks: rank 1"
    assert text in results[1].stderr, said
    assert f"--out {outs[0]} is not one folder shared by all ranks" in results[0].stderr, said
    assert "FileNotFoundError" not in said
    assert not list(outs[0].glob(".shared_check_*"))  # rank 0 cleans up
    assert not (outs[0] / "checkpoints").exists()  # stopped before anything was trained


def test_nodes_with_other_data_stop_naming_it(tmp_path: Path) -> None:
    """--data may name another path on each node, but the tokens must be the same."""
    texts = [tmp_path / "a.txt", tmp_path / "b.txt"]
    texts[0].write_bytes(b"one corpus " * 6000)
    texts[1].write_bytes(b"another one " * 6000)
    out = ["--out", str(tmp_path / "run"), "--steps", "1"]
    results = _two_nodes([[*out, "--data", str(t)] for t in texts])
    said = _said(results)
    assert all(r.returncode != 0 for r in results), said
    for r in results:
        assert "--data: the ranks read different data" in r.stderr, said
        assert "tokens: rank 0 66000, rank 1 72000" in r.stderr, said
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_nodes_with_the_same_command_train(tmp_path: Path) -> None:
    out = ["--out", str(tmp_path / "run"), "--steps", "1"]
    results = _two_nodes([out, out])
    assert all(r.returncode == 0 for r in results), _said(results)
    assert (tmp_path / "run" / "checkpoints" / "step_00000001" / "manifest.json").is_file()
