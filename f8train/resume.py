"""Which checkpoint a run resumes from, chosen and checked before the model is built.

Mental model: ``find_resume`` (a collective: every rank calls it and every rank reaches the
same answer, see ``f8train/checkpoint_manifest.py``) picks a checkpoint, verifies its files
against their manifest, then compares its settings with this run's
(``f8train/resume_settings.py``). No folder that DCP could load is ever deleted:

- ``--resume CKPT``: exactly that checkpoint. If it is damaged the run stops, naming each
  damaged file and what is wrong with it, and the newest intact checkpoint before it with
  the flag that resumes from it (``--resume PREV``). Nothing is moved or deleted. A folder
  without a manifest whose DCP files are all there (saved before manifests existed, or its
  manifest lost) is accepted unverified; its settings are compared with the ``run.json``
  of its run.
- ``--resume`` or auto-resume (``--out`` holds checkpoints): the newest checkpoint whose
  files match. A damaged newer one is renamed ``step_N.damaged`` (kept, never deleted; no
  longer found as a checkpoint, so a restarted job does not trip on it again) and the run
  falls back to the previous intact checkpoint, saying so on stderr. When no checkpoint
  is intact the run stops and nothing is renamed. When the newest folder is *in doubt*
  (DCP files, no manifest) the run stops, names it, and gives both ways on: resume from
  it, or from the newest verified one.
- Checkpoints newer than the one resumed from (``--resume`` of an older one) would be
  overwritten by this run's saves: they are renamed ``step_N.set_aside`` and named.
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

from f8train.checkpoint import SET_ASIDE, Checkpointer, aside_name, dcp_problem, step_of
from f8train.checkpoint_manifest import MANIFEST, Problem, broadcast_from_0, verify
from f8train.resume_settings import refusal, resume_conflicts, saved_settings_from_run_json


@dataclass(frozen=True)
class ResumePoint:
    """A verified checkpoint to resume from."""

    path: Path
    step: int
    settings: dict[str, Any]
    changed: list[str] = field(default_factory=list)  # settings allowed to differ
    damaged: list[Path] = field(default_factory=list)  # passed over, renamed (new names)
    set_aside: list[Path] = field(default_factory=list)  # newer ones, renamed (new names)
    unverified: bool = False  # no manifest: files not checked against checksums


@dataclass(frozen=True)
class _Candidate:
    path: Path
    manifest: dict[str, Any]
    damaged: list[tuple[Path, list[Problem]]] = field(default_factory=list)  # newer, passed over
    unverified: bool = False


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
    saved, allow = found.manifest.get("settings"), args.allow_recipe_change
    conflicts = (
        [] if saved is None else resume_conflicts(saved, settings, allow_recipe_change=allow)
    )
    if conflicts:  # before anything is renamed: a refusal changes nothing
        text = refusal(str(found.path), conflicts, _run_json(found.path), allow)
        for path, problems in found.damaged:
            text += f"\n(newer checkpoint {path} is damaged, so it was not the candidate:\n"
            text += f"{_describe(problems)})"
        raise SystemExit(text)
    changed = [] if saved is None else resume_conflicts(saved, settings, allow_recipe_change=False)
    if found.unverified and ckpt.is_main:
        how = (
            "not compared (no run.json)"
            if saved is None
            else f"compared with {_run_json(found.path)}"
        )
        print(
            f"WARNING: resuming from {found.path}, which has no {MANIFEST}: its files are not "
            f"verified against checksums; settings {how}",
            file=sys.stderr,
            flush=True,
        )
    step = int(found.manifest["step"])
    moved = _set_aside(found.damaged, "damaged", found.path, ckpt.is_main) if found.damaged else []
    newer = _newer_loadable(ckpt, step, found.path)
    aside = _set_aside(newer, SET_ASIDE, found.path, ckpt.is_main) if newer else []
    return ResumePoint(found.path, step, saved or {}, changed, moved, aside, found.unverified)


def _newer_loadable(
    ckpt: Checkpointer, step: int, chosen: Path
) -> list[tuple[Path, list[Problem]]]:
    """Folders under this run's checkpoints, newer than ``step``, that DCP could load: its
    saves would land on them (rank 0 looks, every rank gets its list)."""
    found = None
    if ckpt.is_main:
        found = [
            p
            for p in ckpt.step_dirs()
            if step_of(p) > step and p != chosen and (ckpt.is_complete(p) or not dcp_problem(p))
        ]
    found = broadcast_from_0(found)
    why = [Problem(p.name, f"newer than the checkpoint resumed from ({chosen})") for p in found]
    return [(p, [w]) for p, w in zip(found, why)]


def _run_json(path: Path) -> str:
    return str(Path(path).parent.parent / "run.json")


def _describe(problems: list[Problem]) -> str:
    return "\n".join(f"  {p}" for p in problems)


def _explicit(path: Path) -> _Candidate:
    if not path.is_dir():
        raise SystemExit(f"--resume {path}: no such checkpoint folder")
    if not (path / MANIFEST).exists() and broadcast_from_0(dcp_problem(path)) is None:
        saved = saved_settings_from_run_json(Path(_run_json(path)))
        return _Candidate(path, {"step": step_of(path), "settings": saved}, unverified=True)
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
        after = (
            f"the newest intact one before it is {previous}: resume with --resume {previous} "
            f"(the newer ones are then renamed step_N.{SET_ASIDE}, kept)"
        )
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
    newest = step_of(candidates[-1]) if candidates else -1
    _stop_if_newest_in_doubt(ckpt, candidates[-1] if candidates else None)
    _note_unfinished(ckpt, newest)
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


def _stop_if_newest_in_doubt(ckpt: Checkpointer, newest: Path | None) -> None:
    """A folder newer than every complete checkpoint that DCP could load, but without a
    manifest: neither skipped nor overwritten. The run stops and says how to go on."""
    doubt = broadcast_from_0(ckpt.in_doubt() if ckpt.is_main else None)
    doubt = [p for p in doubt if newest is None or step_of(p) > step_of(newest)]
    if not doubt:
        return
    names = "\n".join(f"  {p}" for p in doubt)
    if newest is None:
        other = "or start a new run with another --out"
    else:
        other = (
            f"or resume from the newest verified checkpoint: --resume {newest} (the newer "
            f"folders are then renamed step_N.{SET_ASIDE}, kept)"
        )
    raise SystemExit(
        f"checkpoint folders in doubt under {ckpt.root}:\n{names}\nthey hold DCP files that "
        f"look loadable (.metadata and every file it names) but no {MANIFEST} (saved before "
        "manifests existed, or the manifest was lost), so their files cannot be verified. "
        "Nothing was deleted or renamed. Resume from the newest: --resume "
        f"{doubt[-1]} (its settings are compared with {_run_json(doubt[-1])}), {other}."
    )


def _note_unfinished(ckpt: Checkpointer, newest: int) -> None:
    """Say so when a newer folder holds DCP files but no manifest: not silently skipped."""
    for path in ckpt.step_dirs():
        if ckpt.is_main and step_of(path) > newest and (path / ".metadata").is_file():
            print(
                f"note: {path} has DCP files but no {MANIFEST} and cannot be loaded "
                f"({dcp_problem(path)}): an interrupted save, not resumed from",
                file=sys.stderr,
                flush=True,
            )


def _set_aside(
    items: list[tuple[Path, list[Problem]]], suffix: str, good: Path, is_main: bool
) -> list[Path]:
    """Rename checkpoints out of the way (rank 0) and say so loudly; returns the new names."""
    moved = [aside_name(path, suffix) for path, _ in items] if is_main else None
    moved = broadcast_from_0(moved)  # one set of names, rank 0's
    if is_main:
        for (path, problems), new in zip(items, moved):
            path.rename(new)
            what = "is damaged" if suffix == "damaged" else "is set aside"
            print(
                f"WARNING: checkpoint {path} {what}:\n{_describe(problems)}\nrenamed it to "
                f"{new} (kept; delete it when done) and resuming from "
                + (f"the previous intact checkpoint {good}" if suffix == "damaged" else f"{good}")
                + f" (step {step_of(good)}). To resume from another checkpoint instead, stop "
                "now and pass --resume CKPT.",
                file=sys.stderr,
                flush=True,
            )
    if dist.is_initialized():
        dist.barrier()  # renamed before any rank lists checkpoints again
    return moved
