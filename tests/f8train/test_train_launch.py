"""The real ``torchrun --standalone --nproc_per_node 2 -m f8train.train`` on a tiny model:
metrics, float8 all-gather bytes, bitwise resume past a damaged checkpoint, a resume
refused for changed settings, resharded resume, a hung collective ended by the timeout.

Two runs are shared by the tests of this module (each launch costs process start-up):
``fp8_run`` (tensorwise, float8 all-gather, 8 steps, checkpoints at 4 and 8) and
``bf16_run`` (``--recipe off --mixed-precision bf16``, for the all-gather bytes).
"""

from __future__ import annotations

import math
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.f8train.launch import REPO, metrics, output_of, run_info, train

STEPS = 8
FP8_ARGS = ("--steps", str(STEPS), "--val-every", "4", "--ckpt-every", "4")
TIMING = {"tokens_per_s", "step_time_s", "peak_memory_bytes", "mfu"}


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fp8") / "run"
    result = train(out, *FP8_ARGS)
    assert result.returncode == 0, output_of(result)
    (out / "stdout.txt").write_text(result.stdout)
    return out


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bf16") / "run"
    args = ("--recipe", "off", "--mixed-precision", "bf16", "--steps", "2", "--val-every", "0")
    result = train(out, *args)
    assert result.returncode == 0, output_of(result)
    return out


def resume_from(source: Path, step: int, out: Path) -> None:
    """A fresh --out holding only ``source``'s checkpoint at ``step`` and its metrics so far."""
    name = f"step_{step:08d}"
    shutil.copytree(source / "checkpoints" / name, out / "checkpoints" / name)
    shutil.copy(source / "metrics.jsonl", out / "metrics.jsonl")  # lines past `step` dropped


def test_smoke_metrics_and_output(fp8_run: Path) -> None:
    records = metrics(fp8_run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"):
            assert math.isfinite(r[key]) and r[key] >= 0, (key, r)
        assert r["all_gather_bytes"] > 0 and r["peak_memory_bytes"] > 0
        assert r["mfu"] is None  # CPU
    losses = [r["loss"] for r in records]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(vals) == 2 and vals[1] < vals[0], vals
    stdout = (fp8_run / "stdout.txt").read_text()
    assert "float8: converted 14 linear layers" in stdout
    assert "skipped output: rejected by module_filter_fn" in stdout
    assert f"step {STEPS}/{STEPS} | loss" in stdout and "all-gather bytes/step" in stdout
    assert (fp8_run / "summary.json").exists()
    saved = sorted(p.name for p in (fp8_run / "checkpoints").iterdir())
    assert saved == ["step_00000004", "step_00000008"]


def test_float8_all_gather_halves_converted_weight_bytes(fp8_run: Path, bf16_run: Path) -> None:
    fp8, bf16 = metrics(fp8_run), metrics(bf16_run)
    fp8_bytes, bf16_bytes = fp8[-1]["all_gather_bytes"], bf16[-1]["all_gather_bytes"]
    assert fp8[-1]["all_gather_count"] == bf16[-1]["all_gather_count"]
    info = run_info(fp8_run)
    # per all-gather of a block, each rank sends its shard of the converted weights in
    # 1 byte instead of 2; everything else (norms, embedding, head) stays bf16. Blocks are
    # gathered twice per step (forward, and again in backward after reshard_after_forward).
    shard = info["float8_params"] / info["world_size"]
    assert bf16_bytes - fp8_bytes == pytest.approx(2 * shard, rel=0.01)
    converted_bf16 = 2 * shard * 2  # the converted weights' bf16 bytes per step
    other = bf16_bytes - converted_bf16
    assert fp8_bytes == pytest.approx(other + converted_bf16 / 2, rel=0.01)
    assert fp8_bytes / bf16_bytes < 0.6


def test_damaged_newest_checkpoint_falls_back_and_resumes_bitwise(
    fp8_run: Path, tmp_path: Path
) -> None:
    """Step 8's shard has one flipped byte in its tensor data, which DCP would load
    without complaint: the checksums catch it, the run says so, sets it aside (kept), resumes
    from step 4 and gives bitwise the uninterrupted run's metrics."""
    out = tmp_path / "resumed"
    resume_from(fp8_run, 4, out)
    shutil.copytree(
        fp8_run / "checkpoints" / "step_00000008", out / "checkpoints" / "step_00000008"
    )
    shard = out / "checkpoints" / "step_00000008" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    result = train(out, *FP8_ARGS)
    assert result.returncode == 0, output_of(result)
    damaged = out / "checkpoints" / "step_00000008"
    assert f"WARNING: checkpoint {damaged} is damaged" in result.stderr, output_of(result)
    assert "__0_0.distcp: contents changed since the save (sha256 differs)" in result.stderr
    assert f"renamed it to {damaged}.damaged" in result.stderr
    assert "resumed from" in result.stdout and "at step 4" in result.stdout
    assert (out / "checkpoints" / "step_00000008.damaged" / "__0_0.distcp").read_bytes() == data
    expected = [{k: v for k, v in r.items() if k not in TIMING} for r in metrics(fp8_run)]
    got = [{k: v for k, v in r.items() if k not in TIMING} for r in metrics(out)]
    assert got == expected  # losses, val losses, lr, grad norms, bytes: all equal
    assert run_info(out)["damaged_checkpoints_set_aside"] == [f"{damaged}.damaged"]


def test_resume_with_other_settings_is_refused_and_changes_nothing(
    fp8_run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "changed"
    shutil.copytree(fp8_run, out)
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    result = train(
        out, *FP8_ARGS, "--steps", "12", "--scaling", "delayed", "--delayed-history", "4"
    )
    assert result.returncode != 0, output_of(result)
    assert f"cannot resume from {out / 'checkpoints' / 'step_00000008'}" in result.stderr
    assert "--scaling: checkpoint dynamic, this run delayed" in result.stderr
    assert "--delayed-history: checkpoint -, this run 4" in result.stderr
    assert 'f8train/train.py", line' not in result.stderr, output_of(result)  # no traceback
    after = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert after == before  # run.json, metrics and both checkpoints untouched


def test_checkpoint_from_2_ranks_resumes_on_1(fp8_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "one_rank"
    resume_from(fp8_run, 4, out)
    result = train(out, *FP8_ARGS, nproc=1)
    assert result.returncode == 0, output_of(result)
    assert "world size 1" in result.stdout
    expected = {r["step"]: r for r in metrics(fp8_run)}
    got = metrics(out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for r in got[4:]:
        # same global batches; float8 input scales come from each rank's own rows, so a
        # different world size changes the numerics slightly
        assert r["loss"] == pytest.approx(expected[r["step"]]["loss"], rel=5e-3)
    assert got[-1]["val_loss"] == pytest.approx(expected[STEPS]["val_loss"], rel=5e-3)


def test_hung_collective_ends_with_a_message(tmp_path: Path) -> None:
    """Rank 1 waits for a message nobody sends after step 1; rank 0 blocks in step 2's
    all-gather. The first to reach --pg-timeout-s says so and exits (rank 1, which started
    waiting first, unless rank 0's wait ends as well before it goes); the other then sees
    the closed connection and says that: a message from each, no 30-minute hang."""
    args = ("--steps", "3", "--val-every", "0", "--hang-at-step", "1", "--pg-timeout-s", "3")
    start = time.monotonic()
    result = train(tmp_path / "hang", *args, timeout=120)
    assert result.returncode != 0, output_of(result)
    assert time.monotonic() - start < 90
    timed_out = "a collective did not complete within --pg-timeout-s 3 s"
    assert timed_out in result.stderr, output_of(result)
    for rank in (0, 1):
        said = (f"rank {rank}: {timed_out}", f"rank {rank}: a collective failed because another")
        assert any(text in result.stderr for text in said), output_of(result)
    assert 'f8train/train.py", line' not in result.stderr, output_of(result)  # no traceback


def test_checkpoints_without_manifest_are_kept_and_resumed_once_trusted(
    fp8_run: Path, tmp_path: Path
) -> None:
    """A run whose checkpoints have DCP files but no manifest.json (saved before manifests
    existed, or the manifests were lost): the rerun stops and names the folder, changing
    nothing and unpickling nothing; ``--resume`` of it is refused the same way; once
    ``python -m f8train.resume --trust`` (the remedy it gives) wrote its manifest, with the
    settings of run.json, ``--resume`` continues from step 8 and both old checkpoints are
    kept."""
    out = tmp_path / "legacy"
    shutil.copytree(fp8_run, out)
    for step in (4, 8):
        (out / "checkpoints" / f"step_{step:08d}" / "manifest.json").unlink()
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    result = train(out, *FP8_ARGS, "--steps", "10")
    assert result.returncode != 0, output_of(result)
    legacy = out / "checkpoints" / "step_00000008"
    assert "checkpoint folders in doubt" in result.stderr, output_of(result)
    trust = f"python -m f8train.resume --trust {legacy}"
    assert trust in result.stderr, output_of(result)
    assert 'f8train/train.py", line' not in result.stderr, output_of(result)  # no traceback
    result = train(out, *FP8_ARGS, "--steps", "10", "--resume", str(legacy))
    assert result.returncode != 0 and trust in result.stderr, output_of(result)
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before

    command = [sys.executable, "-m", "f8train.resume", "--trust", str(legacy)]
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, timeout=60)
    result = train(out, *FP8_ARGS, "--steps", "10", "--resume", str(legacy))
    assert result.returncode == 0, output_of(result)
    assert "resumed from" in result.stdout and "at step 8" in result.stdout
    assert [r["step"] for r in metrics(out)] == list(range(1, 11))
    for old, data in before.items():  # every old checkpoint file kept, byte for byte
        if "checkpoints" in old.parts:
            assert old.read_bytes() == data, old


class _WritesMarker:
    """Unpickling it creates the file ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_planted_checkpoint_metadata_is_not_unpickled_at_start_up(tmp_path: Path) -> None:
    """A ``step_N`` folder without a manifest whose ``.metadata`` would create a marker file
    when unpickled: the trainer names it and stops before anything in it is read."""
    out, marker = tmp_path / "run", tmp_path / "marker"
    planted = out / "checkpoints" / "step_00000005"
    planted.mkdir(parents=True)
    (planted / ".metadata").write_bytes(pickle.dumps(_WritesMarker(marker)))
    (planted / "__0_0.distcp").write_bytes(b"\0" * 64)
    result = train(out, "--steps", "2", nproc=1, timeout=120)
    assert result.returncode != 0, output_of(result)
    assert not marker.exists(), output_of(result)
    assert "checkpoint folders in doubt" in result.stderr and str(planted) in result.stderr
