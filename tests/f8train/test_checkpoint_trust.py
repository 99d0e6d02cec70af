"""Nothing in a checkpoint folder is unpickled before it is verified against its manifest,
and loading a verified one runs no code from it.

DCP's files are pickles, and unpickling one can call any function it names. The first
cases plant, in a ``step_N`` folder without a manifest, a ``.metadata`` whose unpickling
would create a marker file, and run what ``f8train.train`` runs at start-up and at a save on
one process (``find_resume``, pruning, clearing a save's way). The marker must never appear,
and the folder is named: skipped when older than the newest verified checkpoint, a stop
when newer, a refusal for ``--resume``. ``python -m f8train.resume --trust`` writes the
manifest of a folder its owner trusts, after which it resumes. The last cases load a
checkpoint whose manifest matches a planted ``.metadata``, non-tensor item or tensor item
(whoever can write the folder can write its manifest): the load stops, naming the
checkpoint, and the marker never appears.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import subprocess
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.stateful import Stateful

from f8train.checkpoint import (
    MANIFEST,
    Checkpointer,
    ProgressState,
    dcp_problem,
    verify,
    write_manifest,
)
from tests.distributed.launcher import run_distributed
from tests.f8train.checkpoint_setup import find_resume_outcome, resume_args
from tests.f8train.launch import REPO

SETTINGS = {"seed": 0}


class _WritesMarker:
    """Unpickling it opens (creates) the file ``path`` for writing."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _plant(folder: Path, marker: Path) -> None:
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(pickle.dumps(_WritesMarker(marker)))
    (folder / "__0_0.distcp").write_bytes(b"\0" * 64)


def _complete(ckpt: Checkpointer, step: int) -> Path:
    """A folder with DCP's file names and a manifest of them (never loaded here)."""
    path = ckpt.path_for(step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"not read before its checksum matches")
    (path / "__0_0.distcp").write_bytes(bytes(range(64)))
    write_manifest(path, step=step, settings=SETTINGS)
    return path


def test_a_planted_metadata_is_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    ckpt = Checkpointer(tmp_path / "out" / "checkpoints", keep=1, is_main=True)
    older, newer = ckpt.path_for(1), ckpt.path_for(3)
    _plant(older, marker)
    good = _complete(ckpt, 2)
    assert dcp_problem(older) is None and not marker.exists()  # DCP's files are there

    point, stopped, err = find_resume_outcome(resume_args(ckpt.root.parent), ckpt, SETTINGS)
    assert stopped is None and point is not None and point.path == good, stopped
    assert f"note: {older} has DCP files but no {MANIFEST}" in err, err
    assert "not resumed from, nor unpickled" in err
    ckpt._prune()  # keep=1: the older folder is kept (in doubt), not opened
    assert older.is_dir() and not marker.exists()

    point, stopped, err = find_resume_outcome(
        resume_args(ckpt.root.parent, str(older)), ckpt, SETTINGS
    )
    assert point is None and stopped is not None and not marker.exists()
    assert f"--resume {older}: the folder has no {MANIFEST}" in stopped, stopped
    assert f"python -m f8train.resume --trust {older}" in stopped

    _plant(newer, marker)
    point, stopped, err = find_resume_outcome(resume_args(ckpt.root.parent), ckpt, SETTINGS)
    assert stopped is not None and "checkpoint folders in doubt" in stopped, stopped
    assert str(newer) in stopped and "a file damaged since the save would load" in stopped
    assert f"--resume {good}" in stopped  # the verified one, the other way on
    ckpt._clear(newer)  # a save landing on it renames it aside, unopened
    assert not newer.exists() and (ckpt.root / "step_00000003.set_aside").is_dir()
    assert not marker.exists()


def test_a_manifest_must_list_the_metadata_it_guards(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "out" / "checkpoints", keep=2, is_main=True)
    good, bad = _complete(ckpt, 1), _complete(ckpt, 2)
    text = (bad / MANIFEST).read_text().replace('".metadata"', '"other"')
    (bad / MANIFEST).write_text(text)
    point, stopped, err = find_resume_outcome(resume_args(ckpt.root.parent), ckpt, SETTINGS)
    assert point is not None and point.path == good, stopped
    assert "no file list naming .metadata" in err, err


def test_trust_writes_the_manifest_of_a_folder_its_owner_vouches_for(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "out" / "checkpoints", keep=2, is_main=True)
    path = _complete(ckpt, 4)
    (path / MANIFEST).unlink()
    _, stopped, _ = find_resume_outcome(resume_args(ckpt.root.parent), ckpt, SETTINGS)
    assert stopped is not None and f"python -m f8train.resume --trust {path}" in stopped

    command = [sys.executable, "-m", "f8train.resume", "--trust", str(path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and f"wrote {path / MANIFEST}" in done.stdout, done.stderr
    point, stopped, _ = find_resume_outcome(resume_args(ckpt.root.parent), ckpt, SETTINGS)
    assert stopped is None and point is not None and point.path == path and point.step == 4
    data = (path / "__0_0.distcp").read_bytes()
    assert f'"sha256": "{hashlib.sha256(data).hexdigest()}"' in (path / MANIFEST).read_text()

    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert again.returncode != 0 and f"it has a {MANIFEST} already" in again.stderr


class _Holder(Stateful):
    """A Stateful of non-tensor items (DCP pickles each one into its data files)."""

    def __init__(self, items: dict) -> None:
        self.items = items

    def state_dict(self) -> dict:
        return dict(self.items)

    def load_state_dict(self, state_dict: dict) -> None:
        self.items = dict(state_dict)


def _save_and_load(rank, world_size, out: Path, marker: Path):
    ckpt = Checkpointer(out / "checkpoints", keep=2, is_main=True)
    ckpt.save(1, {"progress": ProgressState(step=3, tokens=30)}, SETTINGS)
    ckpt.save(2, {"extra": _Holder({"note": _WritesMarker(marker)})}, SETTINGS)
    progress = ProgressState()
    ckpt.load(ckpt.path_for(1), {"progress": progress})
    try:
        ckpt.load(ckpt.path_for(2), {"extra": _Holder({"note": None})})
    except SystemExit as stop:
        return (progress.step, progress.tokens), str(stop)
    return (progress.step, progress.tokens), None


def test_a_verified_checkpoint_unpickles_its_items_weights_only(tmp_path: Path) -> None:
    """Past its manifest, a checkpoint's non-tensor items (counters, hyperparameters) load as
    plain data: one whose unpickling would run code (create the marker) stops the load,
    naming the checkpoint, and runs nothing."""
    marker = tmp_path / "marker"
    [(progress, stopped)] = run_distributed(
        _save_and_load, 1, tmp_path, tmp_path / "out", marker, timeout_s=120
    )
    assert progress == (3, 30)  # plain items load
    assert not marker.exists()
    assert stopped is not None and "could not load checkpoint" in stopped, stopped
    assert "step_00000002" in stopped and "'extra.note' is not plain data" in stopped, stopped


def _rehash(path: Path, name: str) -> None:
    """Make the manifest's entry of ``path / name`` match the file as it is now."""
    manifest = json.loads((path / MANIFEST).read_text())
    data = (path / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / MANIFEST).write_text(json.dumps(manifest))


def _load_replaced_metadata(rank, world_size, out: Path, marker: Path):
    ckpt = Checkpointer(out / "checkpoints", keep=2, is_main=True)
    path = ckpt.save(1, {"progress": ProgressState(step=3, tokens=30)}, SETTINGS)
    (path / ".metadata").write_bytes(pickle.dumps(_WritesMarker(marker)))
    _rehash(path, ".metadata")
    point, stopped, _ = find_resume_outcome(resume_args(out), ckpt, SETTINGS)
    assert stopped is None and point is not None and point.path == path, stopped
    try:
        ckpt.load(point.path, {"progress": ProgressState()})
    except SystemExit as stop:
        return str(stop)
    return None


def test_a_verified_metadata_that_names_other_code_is_refused(tmp_path: Path) -> None:
    """A ``.metadata`` that matches its manifest (whoever wrote the folder wrote both) but
    whose unpickling would run code (create the marker) is read with an allow-list of DCP's
    metadata classes: the load stops, naming the refused global and the checkpoint."""
    marker = tmp_path / "marker"
    [stopped] = run_distributed(
        _load_replaced_metadata, 1, tmp_path, tmp_path / "out", marker, timeout_s=120
    )
    assert not marker.exists()
    assert stopped is not None and "could not load checkpoint" in stopped, stopped
    assert "names io.open" in stopped and "step_00000001" in stopped, stopped
    assert "Resume from another checkpoint" in stopped, stopped


def _load_replaced_tensor(rank, world_size, out: Path, marker: Path):
    ckpt = Checkpointer(out / "checkpoints", keep=2, is_main=True)
    path = ckpt.save(1, {"extra": _Holder({"w": torch.ones(4)})}, SETTINGS)
    with open(path / ".metadata", "rb") as file:
        metadata = pickle.load(file)  # written just now by this test
    [index] = [i for i in metadata.storage_data if i.fqn == "extra.w"]
    info = metadata.storage_data[index]
    planted = io.BytesIO()
    torch.save(_WritesMarker(marker), planted)  # in place of the tensor's bytes
    data = path / info.relative_path
    info.offset, info.length = data.stat().st_size, len(planted.getvalue())
    with open(data, "ab") as file:
        file.write(planted.getvalue())
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    _rehash(path, ".metadata")
    _rehash(path, info.relative_path)
    assert not verify(path)[1]
    try:
        ckpt.load(path, {"extra": _Holder({"w": torch.zeros(4)})})
    except SystemExit as stop:
        return str(stop)
    return None


def test_a_verified_tensor_item_that_is_not_a_tensor_runs_nothing(tmp_path: Path) -> None:
    """DCP reads each tensor with ``torch.load(weights_only=True)``: a tensor item whose
    unpickling would create the marker stops the load and runs nothing."""
    marker = tmp_path / "marker"
    [stopped] = run_distributed(
        _load_replaced_tensor, 1, tmp_path, tmp_path / "out", marker, timeout_s=120
    )
    assert not marker.exists()
    assert stopped is not None and "could not load checkpoint" in stopped, stopped
    assert "step_00000001" in stopped and "Weights only load failed" in stopped, stopped
