"""No checkpoint that could load is ever deleted, on 2 gloo ranks in-process (one spawn).

A small FSDP2 model saves complete checkpoints at steps 1, 2 and 3 through the trainer's
``Checkpointer``. Each case copies them into a fresh folder and shapes the folder the way
an older run, a lost manifest, a rollback or a full disk would, then calls what
``f8train.train`` calls (``find_resume`` before the model is built, ``Checkpointer.save``
in the loop). Checked every time: both ranks reach the same decision, and every file that
was there before is still there afterwards (possibly under a ``.set_aside`` name).

- ``legacy_newest``: step 3 has DCP files but no ``manifest.json`` (saved before manifests
  existed, or the manifest was lost): a fresh start would delete it at the next save, and
  resuming from it would load files nothing verified. The run stops, names it, and
  offers ``--trust`` of it or ``--resume`` of step 2.
- ``legacy_only``: no manifest anywhere: stops the same way (a fresh start would delete).
- ``legacy_explicit``: ``--resume`` of that folder is refused (nothing verified, nothing
  unpickled); once ``python -m f8train.resume --trust`` wrote its manifest, with the
  settings of the run's ``run.json``, it resumes (a differing ``--seed`` is refused by name).
- ``rollback``: ``--resume`` of step 1 renames the newer complete step 2 and 3 aside.
- ``save_over``: a save landing on a loadable folder renames it aside; pruning keeps an
  older folder without a manifest that could load, and removes an interrupted save.
- ``disk_full``: the disk check before a save (faked) stops both ranks with "No space left
  on device", the sizes, and the remedy; nothing is deleted.
- ``file_size_limit``: a save under a 4 KiB file-size limit (``setrlimit(RLIMIT_FSIZE)``
  in the rank's process, SIGXFSZ ignored) stops both ranks naming the limit, the failed
  write and the remedy, not with DCP's raw error; nothing is deleted.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import f8train.checkpoint as checkpoint_module
from f8train.checkpoint import (
    MANIFEST,
    Checkpointer,
    ModelOptimizerState,
    dcp_problem,
    free_bytes,
)
from f8train.resume import saved_settings_from_run_json
from tests.distributed.launcher import run_distributed
from tests.f8train.checkpoint_setup import find_resume_outcome, model_and_optimizer, resume_args
from tests.f8train.launch import REPO


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _same_files_maybe_renamed(before: dict[str, bytes], after: dict[str, bytes]) -> bool:
    """Every file of ``before`` is in ``after`` with the same bytes, under its own folder's
    name or that name plus ``.set_aside``."""
    for name, data in before.items():
        folder, _, rest = name.partition("/")
        names = (name, f"{folder}.set_aside/{rest}")
        if not any(after.get(n) == data for n in names):
            return False
    return True


def _decide(args: argparse.Namespace, ckpt: Checkpointer, settings: dict) -> dict:
    point, stopped, stderr = find_resume_outcome(args, ckpt, settings)
    if stopped is not None:
        return {"stopped": stopped, "stderr": stderr}
    if point is None:
        return {"step": None, "stderr": stderr}
    aside = [p.name for p in point.set_aside]
    return {"step": point.step, "aside": aside}


def _cases(rank: int, world_size: int, tmp: str) -> dict:
    tmp_path = Path(tmp)
    model, opt = model_and_optimizer(world_size)
    run_settings = saved_settings_from_run_json(tmp_path / "no_such_run.json")
    assert run_settings is None
    pristine = Checkpointer(tmp_path / "pristine" / "checkpoints", keep=5, is_main=rank == 0)
    settings = {"seed": 0}
    for step in (1, 2, 3):
        model(torch.randn(4, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        pristine.save(step, {"app": ModelOptimizerState(model, opt)}, settings)

    def fresh(name: str, *, no_manifest: tuple[int, ...] = ()) -> Checkpointer:
        ckpt = Checkpointer(tmp_path / name / "checkpoints", keep=2, is_main=rank == 0)
        if rank == 0:
            shutil.copytree(pristine.root, ckpt.root)
            for step in no_manifest:
                (ckpt.path_for(step) / MANIFEST).unlink()
        dist.barrier()
        return ckpt

    results: dict = {"root": str(tmp_path)}

    def case(name: str, ckpt: Checkpointer, args: argparse.Namespace, run: dict) -> None:
        before = _files(ckpt.root)
        results[name] = _decide(args, ckpt, run)
        dist.barrier()
        results[name]["kept"] = _same_files_maybe_renamed(before, _files(ckpt.root))
        results[name]["unchanged"] = before == _files(ckpt.root)

    ckpt = fresh("legacy_newest", no_manifest=(3,))
    case("legacy_newest", ckpt, resume_args(ckpt.root.parent), settings)
    ckpt = fresh("legacy_only", no_manifest=(1, 2, 3))
    case("legacy_only", ckpt, resume_args(ckpt.root.parent), settings)

    ckpt = fresh("legacy_explicit", no_manifest=(3,))
    if rank == 0:  # the run.json the legacy run wrote next to its checkpoints
        run_json = {"args": {"seed": 0, "steps": 3}}
        (ckpt.root.parent / "run.json").write_text(json.dumps(run_json))
    dist.barrier()
    legacy = str(ckpt.path_for(3))
    this_run = saved_settings_from_run_json(ckpt.root.parent / "run.json")
    other_seed = dict(this_run, seed=1)
    case("legacy_explicit", ckpt, resume_args(ckpt.root.parent, legacy), this_run)
    if rank == 0:  # its owner vouches for it
        trust = [sys.executable, "-m", "f8train.resume", "--trust", legacy]
        subprocess.run(trust, cwd=REPO, check=True, capture_output=True, timeout=60)
    dist.barrier()
    case("trusted_other_seed", ckpt, resume_args(ckpt.root.parent, legacy), other_seed)
    case("trusted", ckpt, resume_args(ckpt.root.parent, legacy), this_run)

    ckpt = fresh("rollback")
    case("rollback", ckpt, resume_args(ckpt.root.parent, str(ckpt.path_for(1))), settings)

    ckpt = fresh("save_over", no_manifest=(1, 3))
    if rank == 0:  # an interrupted save: DCP's files, but no .metadata
        shutil.copytree(ckpt.path_for(2), ckpt.root / "step_00000000")
        (ckpt.root / "step_00000000" / ".metadata").unlink()
        (ckpt.root / "step_00000000" / MANIFEST).unlink()
    dist.barrier()
    before = _files(ckpt.root)
    problems = {p.name: dcp_problem(p) for p in ckpt.step_dirs()}
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        for step in (3, 4, 5):  # 3 lands on the manifest-less step 3; keep=2 prunes
            ckpt.save(step, {"app": ModelOptimizerState(model, opt)}, settings)
    dist.barrier()
    after = _files(ckpt.root)
    results["save_over"] = {
        "problems": problems,
        "names": sorted(p.name for p in ckpt.root.iterdir()),
        "legacy_kept": all(after.get(k) == v for k, v in before.items() if "_00000001/" in k),
        "moved_kept": all(
            after.get(k.replace("_00000003/", "_00000003.set_aside/")) == v
            for k, v in before.items()
            if "_00000003/" in k
        ),
        "stderr": err.getvalue(),
    }

    ckpt = fresh("disk_full")
    before = _files(ckpt.root)
    checkpoint_module.free_bytes = lambda path: 1000  # the faked disk check: 1000 B free
    try:
        ckpt.save(4, {"app": ModelOptimizerState(model, opt)}, settings)
        results["disk_full"] = {"stopped": None}
    except SystemExit as stop:
        results["disk_full"] = {"stopped": str(stop)}
    dist.barrier()
    results["disk_full"]["unchanged"] = before == _files(ckpt.root)
    checkpoint_module.free_bytes = free_bytes

    ckpt = fresh("file_size_limit")
    before = _files(ckpt.root)
    results["file_size_limit"] = {"stopped": _save_under_file_size_limit(ckpt, model, opt)}
    dist.barrier()
    results["file_size_limit"]["kept"] = _same_files_maybe_renamed(before, _files(ckpt.root))
    return results


def _save_under_file_size_limit(ckpt: Checkpointer, model, opt) -> str | None:
    """A save while this rank's process may write files of at most 4 KiB (`ulimit -f 4`;
    SIGXFSZ ignored, so a write past it fails with EFBIG instead of killing the process).
    Runs in a `run_distributed` child only, and restores the limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        ckpt.save(4, {"app": ModelOptimizerState(model, opt)}, {"seed": 0})
        return None
    except SystemExit as stop:
        return str(stop)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)


def test_loadable_checkpoints_are_never_deleted(tmp_path: Path) -> None:
    ranks = run_distributed(_cases, 2, tmp_path, str(tmp_path), timeout_s=120)
    for name in ranks[0]:  # one decision, whatever the rank
        if name not in ("root", "save_over"):
            a, b = ({k: v for k, v in r[name].items() if k != "stderr"} for r in ranks)
            assert a == b, name
    r = ranks[0]
    root = Path(r["root"])

    out = r["legacy_newest"]
    legacy = root / "legacy_newest" / "checkpoints" / "step_00000003"
    stop = out["stopped"]
    assert "checkpoint folders in doubt" in stop and str(legacy) in stop, stop
    assert f"but no {MANIFEST}" in stop and "Nothing was deleted or renamed" in stop
    assert f"python -m f8train.resume --trust {legacy}" in stop
    assert f"--resume {legacy.parent / 'step_00000002'}" in stop  # the other way on
    assert out["unchanged"]

    stop = r["legacy_only"]["stopped"]
    assert str(root / "legacy_only" / "checkpoints" / "step_00000003") in stop, stop
    assert "another --out" in stop and r["legacy_only"]["unchanged"]

    stop = r["legacy_explicit"]["stopped"]
    legacy = root / "legacy_explicit" / "checkpoints" / "step_00000003"
    assert f"--resume {legacy}: the folder has no {MANIFEST}" in stop, stop
    assert f"--trust {legacy}" in stop and r["legacy_explicit"]["unchanged"]
    stop = r["trusted_other_seed"]["stopped"]
    assert "--seed: checkpoint 0, this run 1" in stop, stop
    assert r["trusted_other_seed"]["unchanged"]
    out = r["trusted"]
    assert out["step"] == 3 and out["aside"] == [], out
    assert out["unchanged"]

    out = r["rollback"]
    assert out["step"] == 1, out
    assert out["aside"] == ["step_00000002.set_aside", "step_00000003.set_aside"]
    assert out["kept"] and not out["unchanged"]

    out = r["save_over"]
    assert out["problems"]["step_00000000"] == "no .metadata (DCP's save did not finish)"
    assert out["problems"]["step_00000001"] is None  # no manifest, but it would load
    assert out["names"] == [
        "step_00000001",  # older, in doubt: kept although keep=2
        "step_00000003.set_aside",  # was in the way of the save at step 3
        "step_00000004",
        "step_00000005",
    ], out
    assert out["legacy_kept"] and out["moved_kept"]
    assert "was in the way of this save and may load" in out["stderr"]

    stop = r["disk_full"]["stopped"]
    assert stop is not None and stop.startswith("No space left on device"), stop
    assert "1000 B free" in stop and "Free space on that disk" in stop
    assert f"resume from {root / 'disk_full' / 'checkpoints' / 'step_00000003'}" in stop
    assert r["disk_full"]["unchanged"]

    stop = r["file_size_limit"]["stopped"]  # was DCP's raw CheckpointException
    assert stop is not None and "could not write checkpoint step 4" in stop, stop
    assert "file-size limit (4.0 KiB, ulimit -f)" in stop and "ulimit -f unlimited" in stop
    assert "OSError: [Errno 27] File too large" in stop and "Traceback" not in stop
    latest = root / "file_size_limit" / "checkpoints" / "step_00000003"
    assert f"resume from {latest}" in stop and "No checkpoint was deleted" in stop
    assert r["file_size_limit"]["kept"]
