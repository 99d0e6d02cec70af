"""Which checkpoint a run resumes from, chosen and checked before the model is built.

``find_resume`` is a collective (every rank reaches the same answer): ``--resume CKPT``
takes that one, otherwise the newest intact one; its files are verified against their
manifest and the settings it depends on (``checkpoint_settings``) compared with this run's.
A folder without a valid manifest is never resumed from (nothing unverified is loaded: its
files could be damaged since the save): a newer one in doubt (DCP files, no manifest) stops
the run, an older one is named and skipped, ``--resume`` of one is refused;
``python -m f8train.resume --trust CKPT`` writes the manifest of a folder its owner trusts.
No folder DCP could load is deleted: a damaged newer one is renamed ``step_N.damaged``, the
newer ones than the one resumed from ``step_N.set_aside``. docs/trainer.md and
docs/reliability.md give every case.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from f8train.checkpoint import SET_ASIDE, Checkpointer, aside_name, dcp_problem, step_of, warn
from f8train.checkpoint_manifest import MANIFEST, verify, write_manifest
from f8train.float8_flags import default_all_gather, parse_static_scales
from f8train.model import build_args
from f8train.process_group import broadcast_from_0, rank_world

RECIPE_SETTINGS = frozenset({"recipe", "fp8_all_gather", "float8_skip"})
_MODEL_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of")


def checkpoint_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings of this run that a checkpoint depends on (plain JSON values)."""
    float8 = args.recipe != "off"
    shape, scaling = build_args(args), args.scaling if float8 else None
    return {
        "model": {k: getattr(shape, k) for k in _MODEL_FIELDS},
        "recipe": args.recipe,
        "scaling": scaling,
        "fp8_all_gather": default_all_gather(args) if float8 else None,
        "delayed_history": args.delayed_history if scaling == "delayed" else None,
        "static_scales": parse_static_scales(args.static_scales) if scaling == "static" else None,
        "float8_skip": sorted(args.float8_skip) if float8 else [],
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "seed": args.seed,
    }


def saved_settings_from_run_json(run_json: Path) -> dict[str, Any] | None:
    """The settings of the run recorded in ``run_json`` (its flags over today's defaults),
    for a checkpoint without a manifest; None when the file is missing or unreadable."""
    from f8train.train_args import build_parser, resolve_defaults

    try:
        recorded = json.loads(Path(run_json).read_text())["args"]
        flags = argparse.Namespace(**(vars(build_parser().parse_args([])) | dict(recorded)))
        resolve_defaults(flags)
        return checkpoint_settings(flags)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, SystemExit):
        return None


def resume_conflicts(
    saved: dict[str, Any],
    current: dict[str, Any],
    *,
    allow_recipe_change: bool,
    allow_batch_change: bool = False,
) -> list[str]:
    """One line per setting that differs: ``flag: checkpoint X, this run Y``."""

    def flat(settings: dict[str, Any]) -> dict[str, Any]:
        model = {f"model.{k}": v for k, v in settings.get("model", {}).items()}
        return {k: v for k, v in settings.items() if k != "model"} | model

    old, new = flat(saved), flat(current)
    differ = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    scalings = {saved.get("scaling"), current.get("scaling")}
    if allow_recipe_change and "delayed" not in scalings:
        waived = set(RECIPE_SETTINGS)
        if scalings <= {None, "dynamic"}:  # off <-> dynamic: no scaling state either side
            waived.add("scaling")
        differ = [k for k in differ if k not in waived]
    if allow_batch_change:
        differ = [k for k in differ if k != "global_batch"]
    return [
        f"{_flag(k)}: checkpoint {_show(old.get(k))}, this run {_show(new.get(k))}" for k in differ
    ]


def _flag(key: str) -> str:
    """The flag that sets a setting (``model.*``: the shape flags or the preset)."""
    name = "--" + key.removeprefix("model.").replace("_", "-")
    if key == "model.vocab_size":
        return "vocab size (--preset)"
    if key == "fp8_all_gather":
        return "--fp8-all-gather / --no-fp8-all-gather"
    return f"{name} (or --preset)" if key.startswith("model.") else name


def _show(value: Any) -> str:
    if value is None or value == []:
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, dict):
        return ",".join(f"{k}={v:g}" for k, v in value.items())
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)


def refusal(path: str, conflicts: list[str], run_json: str, allow_recipe_change: bool) -> str:
    lines = "\n".join(f"  {c}" for c in conflicts)
    hint = ""
    if not allow_recipe_change and any(
        c.startswith(("--recipe", "--fp8", "--float8")) for c in conflicts
    ):
        hint = (
            "\n--allow-recipe-change accepts another --recipe / --fp8-all-gather / "
            "--float8-skip when neither run uses delayed scaling."
        )
    return (
        f"cannot resume from {path}: it was saved with other settings than this run's:\n"
        f"{lines}\nRerun with the checkpoint's flags (its run's are in {run_json}), or "
        f"start a new run with another --out. Nothing was changed in the old run.{hint}"
        + (
            "\n--allow-batch-change accepts another --global-batch (to resume on a world "
            "size that does not divide the saved one)."
            if any(c.startswith("--global-batch") for c in conflicts)
            else ""
        )
    )


@dataclass(frozen=True)
class ResumePoint:
    """A verified checkpoint to resume from."""

    path: Path
    step: int
    changed: list[str] = field(default_factory=list)  # settings allowed to differ
    damaged: list[Path] = field(default_factory=list)  # passed over, renamed (new names)
    set_aside: list[Path] = field(default_factory=list)  # newer ones, renamed (new names)


@dataclass(frozen=True)
class _Candidate:
    path: Path
    manifest: dict[str, Any]
    damaged: list[tuple[Path, list[str]]] = field(default_factory=list)  # newer, passed over


def find_resume(
    args: argparse.Namespace, ckpt: Checkpointer, settings: dict[str, Any]
) -> ResumePoint | None:
    """The checkpoint this run continues from, or None for a fresh start (collective)."""
    explicit = args.resume not in (None, "latest")
    found = _explicit(Path(args.resume)) if explicit else _newest_intact(args, ckpt)
    if found is None:
        return None
    saved, allow = found.manifest.get("settings"), args.allow_recipe_change
    # None: a folder without a manifest whose run.json is gone, so nothing to compare with
    changed = resume_conflicts(saved or settings, settings, allow_recipe_change=False)
    conflicts = resume_conflicts(
        saved or settings,
        settings,
        allow_recipe_change=allow,
        allow_batch_change=getattr(args, "allow_batch_change", False),
    )
    if conflicts:  # before anything is renamed: a refusal changes nothing
        text = refusal(str(found.path), conflicts, _run_json(found.path), allow)
        for path, problems in found.damaged:
            text += f"\n(newer checkpoint {path} is damaged, so it was not the candidate:\n"
            text += f"{_describe(problems)})"
        raise SystemExit(text)
    step = int(found.manifest["step"])
    moved = _set_aside(found.damaged, "damaged", found.path, ckpt.is_main)
    why = f"newer than the checkpoint resumed from ({found.path})"
    newer = [p for p in _loadable(ckpt) if step_of(p) > step and p != found.path]
    aside = [(p, [f"{p.name}: {why}"]) for p in newer]
    aside = _set_aside(aside, SET_ASIDE, found.path, ckpt.is_main)
    return ResumePoint(found.path, step, changed, moved, aside)


def _loadable(ckpt: Checkpointer) -> list[Path]:
    """The step folders DCP could load, with a manifest or without, as rank 0 sees them."""
    found = None
    if ckpt.is_main:
        found = [p for p in ckpt.step_dirs() if ckpt.may_load(p)]
    return broadcast_from_0(found)


def _run_json(path: Path) -> str:
    return str(Path(path).parent.parent / "run.json")


def _describe(problems: list[str]) -> str:
    return "\n".join(f"  {p}" for p in problems)


def _resume_instead(path: Path) -> str:
    return f"--resume {path} (the newer ones are then renamed step_N.{SET_ASIDE}, kept)"


def _explicit(path: Path) -> _Candidate:
    if not path.is_dir():
        raise SystemExit(f"--resume {path}: no such checkpoint folder")
    if not broadcast_from_0((path / MANIFEST).exists() if rank_world()[0] == 0 else None):
        raise SystemExit(
            f"--resume {path}: the folder has no {MANIFEST}, so its files cannot be verified "
            f"before DCP loads them{_UNVERIFIED}. It is not resumed from; nothing was moved "
            f"or deleted. {_trust_remedy(path)}"
        )
    manifest, problems = verify(path)
    if not problems:
        return _Candidate(path, manifest)
    earlier = Checkpointer(path.parent, keep=1, is_main=False).complete()
    earlier = [p for p in reversed(earlier) if step_of(p) < step_of(path)]
    previous = next((p for p in earlier if not verify(p)[1]), None)  # verify: collective
    after = f"no intact checkpoint before it in {path.parent}; start a new run with another --out"
    if previous is not None:
        after = f"the newest intact one before it is {previous}: resume with "
        after += _resume_instead(previous)
    raise SystemExit(
        f"--resume {path}: checkpoint is damaged:\n{_describe(problems)}\n{after}. "
        "Nothing was moved or deleted."
    )


def _newest_intact(args: argparse.Namespace, ckpt: Checkpointer) -> _Candidate | None:
    candidates = ckpt.complete()
    newest = candidates[-1] if candidates else None
    newest_step = step_of(newest) if newest else -1
    doubt = [p for p in _loadable(ckpt) if step_of(p) > newest_step]  # none has a manifest
    if doubt:
        _stop_in_doubt(ckpt, doubt, newest)
    for path in ckpt.step_dirs() if ckpt.is_main else []:  # said, not skipped silently
        if ckpt.is_complete(path) or not (path / ".metadata").is_file():
            continue
        if step_of(path) > newest_step:
            warn(
                f"note: {path} has DCP files but no {MANIFEST} and cannot be loaded "
                f"({dcp_problem(path)}): an interrupted save, not resumed from"
            )
        else:
            warn(
                f"note: {path} has DCP files but no {MANIFEST}, so its files cannot be "
                "verified: not resumed from, nor unpickled (kept; older than the newest "
                "checkpoint with a manifest)"
            )
    if newest is None:
        if args.resume == "latest":
            raise SystemExit(f"--resume: no complete checkpoint under {ckpt.root}")
        return None
    if args.resume is None and not args.auto_resume:
        raise SystemExit(
            f"--out {args.out} already holds checkpoints (latest {newest}); pass "
            "--resume to continue that run, or choose another --out"
        )
    damaged: list[tuple[Path, list[str]]] = []
    for path in reversed(candidates):
        manifest, problems = verify(path)
        if not problems:
            return _Candidate(path, manifest, damaged)
        damaged.append((path, problems))
    found = "\n".join(f"{p}:\n{_describe(pr)}" for p, pr in damaged)
    raise SystemExit(
        f"no intact checkpoint under {ckpt.root} to resume from:\n{found}\nstart a new "
        "run with another --out (nothing was moved or deleted)"
    )


def _stop_in_doubt(ckpt: Checkpointer, doubt: list[Path], newest: Path | None) -> None:
    """Folders newer than every complete checkpoint with DCP's files but without a manifest
    are neither skipped nor overwritten: the run stops and says how to go on."""
    names = _describe([str(p) for p in doubt])
    if newest is None:
        other = "start a new run with another --out"
    else:
        other = f"resume from the newest verified checkpoint: {_resume_instead(newest)}"
    raise SystemExit(
        f"checkpoint folders in doubt under {ckpt.root}:\n{names}\nthey hold DCP files "
        f"(.metadata and .distcp data) but no {MANIFEST} (saved before manifests existed, or "
        "the manifest was lost), so their files cannot be verified, and they are not "
        f"resumed from{_UNVERIFIED}. Nothing was deleted or renamed. "
        f"{_trust_remedy(doubt[-1])} Or {other}."
    )


_UNVERIFIED = " (a file damaged since the save would load wrong state, or fail midway)"


def _trust_remedy(path: Path) -> str:
    return (
        f"If you trust {path} (you or your job wrote it, no one else can write to it, and "
        f"its save finished), write its manifest with `python -m f8train.resume --trust "
        f"{path}` and rerun with --resume {path}."
    )


def _set_aside(
    items: list[tuple[Path, list[str]]], suffix: str, good: Path, is_main: bool
) -> list[Path]:
    """Rename checkpoints out of the way (rank 0) and say so loudly; returns the new names."""
    if not items:  # the same list on every rank
        return []
    moved = broadcast_from_0([aside_name(p, suffix) for p, _ in items] if is_main else None)
    damaged = suffix == "damaged"
    for (path, problems), new in zip(items, moved if is_main else []):
        path.rename(new)
        warn(
            f"WARNING: checkpoint {path} {'is damaged' if damaged else 'is set aside'}:\n"
            f"{_describe(problems)}\nrenamed it to {new} (kept; delete it when done) and "
            f"resuming from {'the previous intact checkpoint ' if damaged else ''}{good} "
            f"(step {step_of(good)}). To resume from another checkpoint instead, stop "
            "now and pass --resume CKPT."
        )
    if dist.is_initialized():
        dist.barrier()  # renamed before any rank lists checkpoints again
    return moved


def trust(path: Path) -> str:
    """Write the manifest of a checkpoint folder that has DCP's files but none, with the
    settings of the ``run.json`` next to it (none when it is missing); what was done."""
    path = Path(path)
    if step_of(path) < 0 or not path.is_dir():
        raise SystemExit(f"--trust {path}: not a checkpoint folder (expected .../step_N)")
    if (path / MANIFEST).exists():
        raise SystemExit(f"--trust {path}: it has a {MANIFEST} already; nothing to do")
    if (problem := dcp_problem(path)) is not None:
        raise SystemExit(f"--trust {path}: not a finished DCP save ({problem})")
    saved = saved_settings_from_run_json(Path(_run_json(path)))
    write_manifest(path, step=step_of(path), settings=saved)
    how = f"settings from {_run_json(path)}" if saved else "no settings (no run.json)"
    return f"wrote {path / MANIFEST}: checksums of its files as they are now, {how}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m f8train.resume",
        description="Write the manifest of a checkpoint folder saved without one, so that "
        "f8train.train may resume from it. Only for a folder you trust: the manifest records "
        "its files as they are now, and a resume loads them as the run's state (weights, "
        "optimizer state, counters), checked against it from then on.",
    )
    parser.add_argument("--trust", required=True, metavar="CKPT", help="a step_N folder")
    print(trust(Path(parser.parse_args(argv).trust)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
