"""The float8 flags of ``f8train/train.py``: from ``--recipe``/``--scaling``/... to a
``Float8LinearConfig``, the filter choosing which linears convert, and a one-line name of
the configuration.
"""

from __future__ import annotations

import argparse
import fnmatch
import math

from torch import nn

from fsdp_float8 import CastConfig, DelayedScalingConfig, Float8LinearConfig
from fsdp_float8.nn.convert import dims_divisible_by_16

RECIPES = ("off", "tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8")
# float8 all-gather by default: tensorwise, and mxfp8 (every linear of the tiny preset has
# whole 32-row blocks per rank); not blockwise: the tiny preset's wk/wv have 64 rows per
# rank on 2 ranks, not whole 128-row blocks, which a block all-gather refuses
DEFAULT_ALL_GATHER = ("tensorwise", "mxfp8")


def default_all_gather(args: argparse.Namespace) -> bool:
    return (
        args.fp8_all_gather
        if args.fp8_all_gather is not None
        else args.recipe in DEFAULT_ALL_GATHER
    )


SCALINGS = ("dynamic", "delayed", "static")
# static scales multiply hp values into float8 range: roughly fp8_max / expected amax
DEFAULT_STATIC_SCALES = {"input": 64.0, "weight": 2048.0, "grad_output": 2.0**20}


def float8_config(args: argparse.Namespace) -> Float8LinearConfig | None:
    """The float8 config the flags ask for (None for ``--recipe off``); exits with the
    config's own message when the combination is refused."""
    if args.recipe == "off":
        return None
    all_gather = default_all_gather(args)
    overrides: dict = {"enable_fsdp_float8_all_gather": all_gather, "emulate": args.emulate}
    if args.scaling != "dynamic":
        if args.recipe != "tensorwise":
            raise SystemExit(
                f"--scaling {args.scaling} with --recipe {args.recipe}: delayed and static "
                "scaling are tensorwise only; use --recipe tensorwise or --scaling dynamic"
            )
        overrides.update(_cast_overrides(args))
    try:
        return Float8LinearConfig.from_recipe_name(args.recipe, **overrides)
    except ValueError as err:
        raise SystemExit(f"float8 config refused: {err}") from None


def _cast_overrides(args: argparse.Namespace) -> dict:
    if args.scaling == "delayed":
        cast = CastConfig(scaling_type="delayed")
        casts = {op: cast for op in DEFAULT_STATIC_SCALES}
        extra = {"delayed_scaling_config": DelayedScalingConfig(history_len=args.delayed_history)}
    else:
        scales = parse_static_scales(args.static_scales)
        casts = {op: CastConfig(scaling_type="static", static_scale=s) for op, s in scales.items()}
        extra = {}
    return {f"cast_config_{op}": cast for op, cast in casts.items()} | extra


def parse_static_scales(text: str | None) -> dict[str, float]:
    """``"input=64,weight=2048"`` -> scales per operand, defaults for the rest. Raises
    ``ValueError`` naming the item for a bad name or a value that is not a finite number
    > 0."""
    scales = dict(DEFAULT_STATIC_SCALES)
    example = "e.g. input=64,weight=2048,grad_output=1048576"
    for item in filter(None, (text or "").split(",")):
        name, _, value = item.partition("=")
        if name.strip() not in scales or not value:
            raise ValueError(
                f"--static-scales item {item!r}; expected NAME=VALUE with NAME in "
                f"{sorted(scales)}, {example}"
            )
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if not (math.isfinite(number) and number > 0):
            raise ValueError(
                f"--static-scales item {item!r}: {value!r} is not a finite number > 0 (a "
                f"scale multiplies values into float8 range: about 448 / their amax); {example}"
            )
        scales[name.strip()] = number
    return scales


def float8_filter(skip_patterns: list[str]):
    """Convert the linears inside the blocks whose dims are multiples of 16, except those
    matching a ``--float8-skip`` glob; the output head always stays high precision."""

    def accept(module: nn.Module, fqn: str) -> bool:
        if not fqn.startswith("blocks."):
            return False
        if any(fnmatch.fnmatchcase(fqn, p) for p in skip_patterns):
            return False
        return dims_divisible_by_16(module, fqn)

    return accept


def expert_filter(skip_patterns: list[str]):
    """Convert every experts module (MoE presets) except those matching a ``--float8-skip``
    glob; the conversion report says why any other is skipped."""
    return lambda module, fqn: not any(fnmatch.fnmatchcase(fqn, p) for p in skip_patterns)


def describe(a: argparse.Namespace) -> str:
    """One line naming the configuration, e.g. 'tensorwise/dynamic fp8-all-gather bf16'."""
    if a.recipe == "off":
        parts = ["off"]
    else:
        parts = [f"{a.recipe}/{a.scaling}"]
        all_gather = default_all_gather(a)
        parts.append("fp8-all-gather" if all_gather else "hp-all-gather")
        if all_gather and a.scaling == "dynamic" and a.recipe == "tensorwise":
            parts.append("precompute" if a.precompute else "no-precompute")
    parts.append(a.mixed_precision)
    if a.hsdp_replicate > 1:
        parts.append(f"hsdp-replicate={a.hsdp_replicate}")
    if getattr(a, "tp", 1) > 1:
        parts.append(f"tp={a.tp}")
    parts += [flag for flag in ("activation_checkpointing", "compile") if getattr(a, flag)]
    return " ".join(parts)
