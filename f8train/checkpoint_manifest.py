"""Checksums of a checkpoint folder: written after the save, verified before the load.

Mental model: once DCP's save has finished on every rank, the folder's files are hashed
(sha256, stdlib ``hashlib``), each rank taking a share (sorted names, every world-th one),
and rank 0 writes ``manifest.json`` (to a temporary name, then renamed) listing every file
with its size and digest, plus the run settings the checkpoint depends on. The manifest is
the mark of a finished save: a folder without one is an interrupted save.

Verification splits the work the same way. Rank 0 reads the manifest and broadcasts it;
each rank checks its share (present? same size? same digest?); the findings are
all-gathered, so every rank holds the same sorted list of ``Problem``s and takes the same
decision: no rank can go on while another stops, and none waits in a collective the others
skipped. The checkpoint folder must be on a file system all ranks see (DCP needs that for
resharded loads anyway).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

MANIFEST = "manifest.json"
FORMAT = 1


@dataclass(frozen=True, order=True)
class Problem:
    """One finding about one file of a checkpoint: what is wrong with it."""

    file: str
    what: str

    def __str__(self) -> str:
        return f"{self.file}: {self.what}"


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather_object(obj: Any) -> list[Any]:
    rank, world = _rank_world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def broadcast_from_0(obj: Any) -> Any:
    if _rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _checkpoint_files(path: Path) -> list[str]:
    """Every file under ``path`` but the manifest, as sorted relative POSIX names."""
    names = (p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    return sorted(n for n in names if n != MANIFEST and not n.startswith(f"{MANIFEST}."))


def write_manifest(path: Path, *, step: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Hash the saved folder (collective: every rank calls it) and, on rank 0, write
    ``manifest.json``. Returns the manifest."""
    path = Path(path)
    rank, world = _rank_world()
    names = broadcast_from_0(_checkpoint_files(path) if rank == 0 else None)
    mine = {n: _entry(path / n) for n in names[rank::world]}
    files: dict[str, Any] = {}
    for part in all_gather_object(mine):
        files.update(part)
    manifest = {
        "format": FORMAT,
        "step": step,
        "world_size": world,
        "files": dict(sorted(files.items())),
        "settings": settings,
    }
    if rank == 0:
        tmp = path / f"{MANIFEST}.tmp{os.getpid()}"
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, path / MANIFEST)
    return manifest


def _entry(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def read_manifest(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(manifest, None)``, or ``(None, why it cannot be used)``."""
    file = Path(path) / MANIFEST
    if not file.is_file():
        return None, f"no {MANIFEST} (the save did not finish, or f8train.train did not write it)"
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"{MANIFEST} cannot be read ({err})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if manifest.get("format") != FORMAT or not isinstance(files, dict) or not files:
        return None, f"{MANIFEST} is not a format-{FORMAT} manifest with a file list"
    return manifest, None


def _check(path: Path, name: str, expected: dict[str, Any]) -> Problem | None:
    file = path / name
    if not file.is_file():
        return Problem(name, "missing (listed in the manifest, not on disk)")
    size = file.stat().st_size
    if size != expected.get("bytes"):
        return Problem(name, f"{size} bytes on disk, {expected.get('bytes')} when saved")
    if file_sha256(file) != expected.get("sha256"):
        return Problem(name, "contents changed since the save (sha256 differs)")
    return None


def verify(path: Path) -> tuple[dict[str, Any] | None, list[Problem]]:
    """Check a checkpoint against its manifest (collective: every rank calls it, and every
    rank gets the same answer). Returns the manifest and the problems found (none: intact)."""
    path = Path(path)
    rank, world = _rank_world()
    manifest, why = read_manifest(path) if rank == 0 else (None, None)
    manifest, why = broadcast_from_0((manifest, why))
    if manifest is None:
        return None, [Problem(MANIFEST, why)]
    names = sorted(manifest["files"])
    mine = [_check(path, n, manifest["files"][n]) for n in names[rank::world]]
    found = [p for part in all_gather_object([p for p in mine if p is not None]) for p in part]
    return manifest, sorted(found)
