"""A checkpoint's manifest: the record that a save finished and what its files held.

``manifest.json`` sits in a checkpoint folder next to DCP's files and lists each of them with
its size and sha256, with the step, the world size and the run's settings. It is written
last, so its presence marks a finished save. ``verify`` reads it back and checks every
listed file against it; both the hashing at save time and the checking at load time are
collective, each rank doing a share of the files and all ranks ending with the same answer.
Nothing here unpickles anything: a folder is trusted only after it matches its manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from f8train.process_group import all_gather_object, broadcast_from_0, rank_world

MANIFEST = "manifest.json"
FORMAT = 1


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _each_rank_a_share(names: list[str], fn: Callable[[str], Any]) -> dict[str, Any]:
    """``{name: fn(name)}`` over all ``names``, each rank computing a share (collective)."""
    rank, world = rank_world()
    mine = {n: fn(n) for n in names[rank::world]}
    return {k: v for part in all_gather_object(mine) for k, v in part.items()}


def write_manifest(path: Path, *, step: int, settings: dict[str, Any]) -> None:
    """Hash the saved folder (collective) and, on rank 0, write ``manifest.json`` (to a
    temporary name, then renamed)."""
    rank, world = rank_world()
    names = None
    if rank == 0:
        found = (p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
        names = sorted(n for n in found if n != MANIFEST and not n.startswith(f"{MANIFEST}."))
    files = _each_rank_a_share(
        broadcast_from_0(names),
        lambda n: {"bytes": (path / n).stat().st_size, "sha256": _sha256(path / n)},
    )
    manifest = {"format": FORMAT, "step": step, "world_size": world, "settings": settings}
    manifest["files"] = dict(sorted(files.items()))
    if rank == 0:
        tmp = path / f"{MANIFEST}.tmp{os.getpid()}"
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, path / MANIFEST)


def read_manifest(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(manifest, None)``, or ``(None, why it cannot be used)``."""
    file = Path(path) / MANIFEST
    if not file.is_file():
        return None, f"no {MANIFEST} (the save did not finish, or f8train.train did not write it)"
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        return None, f"{MANIFEST} cannot be read ({type(err).__name__}: {err})"
    if (problem := _manifest_shape_problem(manifest)) is not None:
        return None, (
            f"{MANIFEST} is not a format-{FORMAT} manifest with a file list ({problem}); "
            "f8train.train writes it at the end of each save"
        )
    return manifest, None


def _manifest_shape_problem(manifest: object) -> str | None:
    """What in ``manifest`` (parsed JSON) is not as ``write_manifest`` writes it."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    if manifest.get("format") != FORMAT:
        return f"format {manifest.get('format')!r}"
    step, files = manifest.get("step"), manifest.get("files")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"step {step!r}, not a step number"
    if not isinstance(manifest.get("settings"), dict | None):
        return "settings are not an object"
    if not isinstance(files, dict) or ".metadata" not in files:
        return "no file list naming .metadata"
    for name, entry in files.items():
        size = entry.get("bytes") if isinstance(entry, dict) else None
        if not isinstance(size, int) or not isinstance(entry.get("sha256"), str):
            return f"the entry of {name!r} is not bytes and sha256"
    return None


def _check(path: Path, name: str, expected: dict[str, Any]) -> str | None:
    file = path / name
    if not file.is_file():
        return f"{name}: missing (listed in the manifest, not on disk)"
    size = file.stat().st_size
    if size != expected.get("bytes"):
        return f"{name}: {size} bytes on disk, {expected.get('bytes')} when saved"
    if _sha256(file) != expected.get("sha256"):
        return f"{name}: contents changed since the save (sha256 differs)"
    return None


def verify(path: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """Check a checkpoint against its manifest (collective, same answer on every rank).
    Returns the manifest and a sorted line per damaged file, ``file: what`` (none: intact)."""
    manifest, why = broadcast_from_0(read_manifest(path) if rank_world()[0] == 0 else None)
    if manifest is None:
        return None, [f"{MANIFEST}: {why}"]
    files = manifest["files"]
    found = _each_rank_a_share(sorted(files), lambda n: _check(path, n, files[n]))
    return manifest, sorted(p for p in found.values() if p is not None)
