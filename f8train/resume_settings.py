"""The flags a checkpoint depends on, and the refusal to resume under other ones.

Mental model: ``checkpoint_settings(args)`` is the part of a run's configuration that shapes
what a checkpoint holds or means: the model's shape, the float8 recipe and scaling (delayed
scaling adds amax histories of ``--delayed-history`` entries to the model state), whether
weights are all-gathered in float8, which linears stay high precision, and the data layout
(the batcher replays batches by seed and step). It is stored in the checkpoint's manifest.
On resume ``resume_conflicts`` compares the stored settings with this run's, and any
difference stops the run before the model is built, naming each flag with both values.

Flags that do not shape the state (``--steps``, ``--lr``, ``--mixed-precision``,
``--compile``, the world size, ...) may change freely. ``--allow-recipe-change`` lets
``--recipe``, ``--fp8-all-gather`` and ``--float8-skip`` differ (weights are stored in high
precision, so they load into any recipe) when neither run uses delayed scaling, whose
per-layer state would not match.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from f8train.float8_flags import default_all_gather, parse_static_scales
from f8train.sharded_model import build_args

# setting -> the flag that sets it (model.* are the shape flags / the preset)
_FLAGS = {
    "recipe": "--recipe",
    "scaling": "--scaling",
    "fp8_all_gather": "--fp8-all-gather / --no-fp8-all-gather",
    "delayed_history": "--delayed-history",
    "static_scales": "--static-scales",
    "float8_skip": "--float8-skip",
    "seq_len": "--seq-len",
    "global_batch": "--global-batch",
    "seed": "--seed",
}
RECIPE_SETTINGS = frozenset({"recipe", "fp8_all_gather", "float8_skip"})


def checkpoint_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings of this run that a checkpoint depends on (plain JSON values)."""
    float8 = args.recipe != "off"
    all_gather = default_all_gather(args)
    shape = build_args(args)
    return {
        "model": {k: getattr(shape, k) for k in _MODEL_FIELDS},
        "recipe": args.recipe,
        "scaling": args.scaling if float8 else None,
        "fp8_all_gather": all_gather if float8 else None,
        "delayed_history": args.delayed_history if float8 and args.scaling == "delayed" else None,
        "static_scales": parse_static_scales(args.static_scales)
        if float8 and args.scaling == "static"
        else None,
        "float8_skip": sorted(args.float8_skip) if float8 else [],
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "seed": args.seed,
    }


def saved_settings_from_run_json(run_json: Path) -> dict[str, Any] | None:
    """The settings of the run recorded in ``run_json`` (its flags over today's defaults),
    for a checkpoint without a manifest; None when the file is missing or unreadable."""
    from f8train.train_args import build_parser, resolve_defaults  # imports this one's peers

    try:
        recorded = json.loads(Path(run_json).read_text())["args"]
        flags = argparse.Namespace(**(vars(build_parser().parse_args([])) | dict(recorded)))
        resolve_defaults(flags)
        return checkpoint_settings(flags)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, SystemExit):
        return None


_MODEL_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of")


def _flat(settings: dict[str, Any]) -> dict[str, Any]:
    flat = {k: v for k, v in settings.items() if k != "model"}
    flat |= {f"model.{k}": v for k, v in settings.get("model", {}).items()}
    return flat


def _flag(key: str) -> str:
    if key.startswith("model."):
        name = key.removeprefix("model.").replace("_", "-")
        return f"--{name} (or --preset)" if name != "vocab-size" else "vocab size (--preset)"
    return _FLAGS.get(key, key)


def resume_conflicts(
    saved: dict[str, Any], current: dict[str, Any], *, allow_recipe_change: bool
) -> list[str]:
    """One line per setting that differs: ``flag: checkpoint X, this run Y``."""
    old, new = _flat(saved), _flat(current)
    differ = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    scalings = {saved.get("scaling"), current.get("scaling")}
    if allow_recipe_change and "delayed" not in scalings:
        waived = set(RECIPE_SETTINGS)
        if scalings <= {None, "dynamic"}:  # off <-> dynamic: no scaling state either side
            waived.add("scaling")
        differ = [k for k in differ if k not in waived]
    return [
        f"{_flag(k)}: checkpoint {_show(old.get(k))}, this run {_show(new.get(k))}" for k in differ
    ]


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
    """The message of a refused resume."""
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
    )
