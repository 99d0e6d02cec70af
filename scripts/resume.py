"""Which checkpoint a run resumes from, chosen and checked before the model is built.

Mental model: ``find_resume`` (a collective: every rank calls it and every rank reaches the
same answer, see ``scripts/checkpoint_manifest.py``) picks a checkpoint, verifies its files
against their manifest, then compares its settings with this run's
(``scripts/resume_settings.py``):

- ``--resume CKPT``: exactly that checkpoint. If it is damaged the run stops, naming each
  damaged file and what is wrong with it, and the newest intact checkpoint before it with
  the flag that resumes from it (``--resume PREV``). Nothing is moved or deleted.
- ``--resume`` or auto-resume (``--out`` holds checkpoints): the newest checkpoint whose
  files match. A damaged newer one is renamed ``step_N.damaged`` (kept, never deleted; no
  longer found as a checkpoint, so a restarted job does not trip on it again) and the run
  falls back to the previous intact checkpoint, saying so on stderr. When no checkpoint
  is intact the run stops and nothing is renamed.
- Settings that differ stop the run with each flag and both values named; ``run.json`` and
  the checkpoints of the old run are left as they are.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from scripts.checkpoint import Checkpointer, step_of
from scripts.checkpoint_manifest import MANIFEST, Problem, verify
from scripts.resume_settings import refusal, resume_conflicts


@dataclass(frozen=True)
class ResumePoint:
    """A verified checkpoint to resume from."""

    path: Path
    step: int
    settings: dict[str, Any]
    changed: list[str] = field(default_factory=list)  # settings allowed to differ
    damaged: list[Path] = field(default_factory=list)  # passed over, renamed (new names)


@dataclass(frozen=True)
class _Candidate:
    path: Path
    manifest: dict[str, Any]
    damaged: list[tuple[Path, list[Problem]]] = field(default_factory=list)  # newer, passed over


def find_resume(
    args: argparse.Namespace, ckpt: Checkpointer, settings: dict[str, Any]
) -> ResumePoint | None:
    """The checkpoint this run continues from, or None for a fresh start (collective)."""
    if args.resume not in (None, "latest"):
        found = _explicit(Path(args.resume))
    else:
        found = _newest_intact(args, ckpt)
    if found is None:
        return None
    saved, allow = found.manifest.get("settings", {}), args.allow_recipe_change
    conflicts = resume_conflicts(saved, settings, allow_recipe_change=allow)
    if conflicts:  # before anything is renamed: a refusal changes nothing
        text = refusal(str(found.path), conflicts, _run_json(found.path), allow)
        for path, problems in found.damaged:
            text += f"\n(newer checkpoint {path} is damaged, so it was not the candidate:\n"
            text += f"{_describe(problems)})"
        raise SystemExit(text)
    changed = resume_conflicts(saved, settings, allow_recipe_change=False)
    moved = _set_aside(found.damaged, found.path, ckpt.is_main) if found.damaged else []
    return ResumePoint(found.path, int(found.manifest["step"]), saved, changed, moved)


def _run_json(path: Path) -> str:
    return str(Path(path).parent.parent / "run.json")


def _describe(problems: list[Problem]) -> str:
    return "\n".join(f"  {p}" for p in problems)


def _explicit(path: Path) -> _Candidate:
    if not path.is_dir():
        raise SystemExit(f"--resume {path}: no such checkpoint folder")
    manifest, problems = verify(path)
    if not problems:
        return _Candidate(path, manifest)
    earlier = [p for p in Checkpointer(path.parent, keep=1, is_main=False).complete()]
    previous = _newest_verified([p for p in earlier if step_of(p) < step_of(path)])
    if previous is None:
        after = (
            f"no intact checkpoint before it in {path.parent}; start a new run with another --out"
        )
    else:
        after = f"the newest intact one before it is {previous}: resume with --resume {previous}"
    raise SystemExit(
        f"--resume {path}: checkpoint is damaged:\n{_describe(problems)}\n{after}. "
        "Nothing was moved or deleted."
    )


def _newest_verified(candidates: list[Path]) -> Path | None:
    for path in reversed(candidates):
        if not verify(path)[1]:
            return path
    return None


def _newest_intact(args: argparse.Namespace, ckpt: Checkpointer) -> _Candidate | None:
    candidates = ckpt.complete()
    _note_unfinished(ckpt, step_of(candidates[-1]) if candidates else -1)
    if not candidates:
        if args.resume == "latest":
            raise SystemExit(f"--resume: no complete checkpoint under {ckpt.root}")
        return None
    if args.resume is None and not args.auto_resume:
        raise SystemExit(
            f"--out {args.out} already holds checkpoints (latest {candidates[-1]}); pass "
            "--resume to continue that run, or choose another --out"
        )
    damaged: list[tuple[Path, list[Problem]]] = []
    for path in reversed(candidates):
        manifest, problems = verify(path)
        if not problems:
            break
        damaged.append((path, problems))
    else:
        found = "\n".join(f"{p}:\n{_describe(pr)}" for p, pr in damaged)
        raise SystemExit(
            f"no intact checkpoint under {ckpt.root} to resume from:\n{found}\nstart a new "
            "run with another --out (nothing was moved or deleted)"
        )
    return _Candidate(path, manifest, damaged)


def _note_unfinished(ckpt: Checkpointer, newest: int) -> None:
    """Say so when a newer folder holds DCP files but no manifest: not silently skipped."""
    for path in ckpt.step_dirs():
        if ckpt.is_main and step_of(path) > newest and (path / ".metadata").is_file():
            print(
                f"note: {path} has DCP files but no {MANIFEST} (its save stopped before the "
                "checksums were written), so it is not resumed from",
                file=sys.stderr,
                flush=True,
            )


def _set_aside(damaged: list[tuple[Path, list[Problem]]], good: Path, is_main: bool) -> list[Path]:
    """Rename the damaged checkpoints (rank 0) and say so loudly; returns the new names."""
    moved = [_aside_name(path) for path, _ in damaged] if is_main else None
    if dist.is_initialized():  # one set of names, rank 0's
        box = [moved]
        dist.broadcast_object_list(box, src=0)
        moved = box[0]
    if is_main:
        for (path, problems), new in zip(damaged, moved):
            path.rename(new)
            print(
                f"WARNING: checkpoint {path} is damaged:\n{_describe(problems)}\nrenamed it to "
                f"{new} (kept; delete it when done) and resuming from the previous intact "
                f"checkpoint {good} (step {step_of(good)}). To resume from another "
                "checkpoint instead, stop now and pass --resume CKPT.",
                file=sys.stderr,
                flush=True,
            )
    if dist.is_initialized():
        dist.barrier()  # renamed before any rank lists checkpoints again
    return moved


def _aside_name(path: Path) -> Path:
    new, n = path.with_name(f"{path.name}.damaged"), 1
    while new.exists():
        n += 1
        new = path.with_name(f"{path.name}.damaged{n}")
    return new
