"""The float8 flags of ``f8train/train.py``: ``float8_config`` (the flags to a
``Float8LinearConfig``), the filters choosing which layers convert, ``describe`` (a one-line
name of the configuration), and the refusals of float8 flags that would do nothing or cannot
run: a flag that changes nothing is a silent bug in the user's command, so ``flag_problems``
names each one with the remedy. Globs and block shapes are checked on the model built on the
meta device, before any process group exists.
"""

from __future__ import annotations

import argparse
import fnmatch
import math

import torch
from torch import nn

from f8train.model import Transformer, build_args
from f8train.moe import GroupedExperts
from fsdp_float8 import (
    CastConfig,
    DelayedScalingConfig,
    Float8LinearConfig,
    Gemm,
    NVFP4Config,
    Operand,
)
from fsdp_float8.nn.convert import dims_divisible_by_16

# nvfp4_4over6: NVFP4 with four-over-six block scales (NVFP4Config(four_over_six=True))
NVFP4_RECIPES = ("nvfp4", "nvfp4_4over6")
RECIPES = ("off", "tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8")
RECIPES += NVFP4_RECIPES
SCALINGS = ("dynamic", "delayed", "static")
# float8 all-gather by default: tensorwise, and mxfp8 (every linear of the tiny preset has
# whole 32-row blocks per rank); not blockwise: the tiny preset's wk/wv have 64 rows per
# rank on 2 ranks, not whole 128-row blocks, which a block all-gather refuses
DEFAULT_ALL_GATHER = ("tensorwise", "mxfp8", *NVFP4_RECIPES)  # nvfp4: 16-row tiles
# recipes whose float8-gathered weights carry a scale from the whole weight's amax (an
# NVFP4 tensor amax), which the float8 step precomputes (what --no-precompute turns off)
PRECOMPUTED = ("tensorwise", *NVFP4_RECIPES)
# recipes whose GEMMs are emulated on CPU whatever --emulate says (no CPU kernel)
CPU_EMULATED = ("blockwise", "mxfp8", *NVFP4_RECIPES)
# static scales multiply hp values into float8 range: roughly fp8_max / expected amax
DEFAULT_STATIC_SCALES = {"input": 64.0, "weight": 2048.0, "grad_output": 2.0**20}
# flags that act only on float8 layers, as (attribute, flag, is it set?)
_FLOAT8_ONLY = (
    ("scaling", "--scaling", lambda v: v != "dynamic"),
    ("fp8_all_gather", "--fp8-all-gather / --no-fp8-all-gather", lambda v: v is not None),
    ("static_scales", "--static-scales", lambda v: v is not None),
    ("delayed_history", "--delayed-history", lambda v: v is not None),
    ("float8_skip", "--float8-skip", bool),
    ("emulate", "--emulate", bool),
    ("numerics_every", "--numerics-every", bool),
    ("precompute", "--no-precompute", lambda v: not v),
)
# flags that act only with one --scaling, as (attribute, flag, that scaling)
_SCALING_ONLY = (
    ("static_scales", "--static-scales", "static"),
    ("delayed_history", "--delayed-history", "delayed"),
)


def default_all_gather(args: argparse.Namespace) -> bool:
    """``--fp8-all-gather``, or the recipe's default when not given."""
    return args.recipe in DEFAULT_ALL_GATHER if args.fp8_all_gather is None else args.fp8_all_gather


def float8_config(args: argparse.Namespace) -> Float8LinearConfig | NVFP4Config | None:
    """The float8 config the flags ask for (None for ``--recipe off``; an NVFP4Config for
    ``--recipe nvfp4`` and ``nvfp4_4over6``); exits with the config's own message when the combination is
    refused."""
    if args.recipe == "off":
        return None
    if args.recipe in NVFP4_RECIPES:
        if args.scaling != "dynamic":
            raise SystemExit(
                f"--scaling {args.scaling} with --recipe {args.recipe}: NVFP4 scales are "
                "dynamic (each tensor's own amax); use --scaling dynamic"
            )
        return NVFP4Config(
            enable_fsdp_float8_all_gather=default_all_gather(args),
            emulate=args.emulate,
            four_over_six=args.recipe == "nvfp4_4over6",
        )
    overrides: dict = {
        "enable_fsdp_float8_all_gather": default_all_gather(args),
        "emulate": args.emulate,
    }
    if args.scaling != "dynamic":
        if args.recipe != "tensorwise":
            raise SystemExit(
                f"--scaling {args.scaling} with --recipe {args.recipe}: delayed and static "
                "scaling are tensorwise only; use --recipe tensorwise or --scaling dynamic"
            )
        if args.scaling == "delayed":
            casts = dict.fromkeys(DEFAULT_STATIC_SCALES, CastConfig(scaling_type="delayed"))
            history = DelayedScalingConfig(history_len=args.delayed_history)
            overrides["delayed_scaling_config"] = history
        else:
            scales = parse_static_scales(args.static_scales)
            casts = {k: CastConfig("static", static_scale=s) for k, s in scales.items()}
        overrides |= {f"cast_config_{op}": cast for op, cast in casts.items()}
    try:
        return Float8LinearConfig.from_recipe_name(args.recipe, **overrides)
    except ValueError as err:
        raise SystemExit(f"float8 config refused: {err}") from None


def parse_static_scales(text: str | None) -> dict[str, float]:
    """``"input=64,weight=2048"`` -> scales per operand, defaults for the rest. Raises
    ``ValueError`` naming the item for a bad name or a value not a finite number > 0."""
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
    return lambda module, fqn: (
        fqn.startswith("blocks.")
        and not any(fnmatch.fnmatchcase(fqn, p) for p in skip_patterns)
        and dims_divisible_by_16(module, fqn)
    )


def expert_filter(skip_patterns: list[str]):
    """Convert every experts module (MoE presets) except those matching a ``--float8-skip``
    glob; the conversion report says why any other is skipped."""
    return lambda module, fqn: not any(fnmatch.fnmatchcase(fqn, p) for p in skip_patterns)


def describe(a: argparse.Namespace) -> str:
    """One line naming the configuration, e.g.
    'tensorwise/dynamic fp8-all-gather precompute bf16 reduce-fp32'."""
    parts = ["off"]
    if a.recipe != "off":
        all_gather = default_all_gather(a)
        low = "fp4-all-gather" if a.recipe in NVFP4_RECIPES else "fp8-all-gather"
        parts = [f"{a.recipe}/{a.scaling}", low if all_gather else "hp-all-gather"]
        if all_gather and a.scaling == "dynamic" and a.recipe == "tensorwise":
            parts.append("precompute" if a.precompute else "no-precompute")
    # gradients reduce in float32 whatever --mixed-precision says (`sharded_model`): named,
    # since FSDP2's default for reduce_dtype=None differs across torch versions
    parts += [a.mixed_precision, "reduce-fp32"]
    if a.hsdp_replicate > 1:
        parts.append(f"hsdp-replicate={a.hsdp_replicate}")
    if a.tp > 1:
        parts.append(f"tp={a.tp}")
    parts += [flag for flag in ("activation_checkpointing", "compile") if getattr(a, flag)]
    return " ".join(parts)


def flag_problems(args: argparse.Namespace) -> list[str]:
    """One line per float8 flag this run would ignore or cannot read (empty: none)."""
    if args.recipe == "off":
        return [
            f"{flag} has no effect with --recipe off (nothing is converted to float8); "
            "drop it, or choose a float8 --recipe"
            for attr, flag, is_set in _FLOAT8_ONLY
            if is_set(getattr(args, attr))
        ]
    problems = [
        f"{flag} {value} is used only with --scaling {scaling} (this run: --scaling "
        f"{args.scaling}); add --scaling {scaling}, or drop it"
        for attr, flag, scaling in _SCALING_ONLY
        if (value := getattr(args, attr)) is not None and args.scaling != scaling
    ]
    if args.static_scales is not None:
        try:
            parse_static_scales(args.static_scales)
        except ValueError as err:
            problems.append(str(err))
    if not args.precompute and args.scaling != "dynamic":
        problems.append(
            f"--no-precompute applies to --scaling dynamic only (this run: --scaling "
            f"{args.scaling}, whose sync needs the refresh hook); drop it"
        )
    elif not args.precompute and not (default_all_gather(args) and args.recipe in PRECOMPUTED):
        gather = "--fp8-all-gather" if default_all_gather(args) else "--no-fp8-all-gather"
        problems.append(
            f"--no-precompute changes nothing with --recipe {args.recipe} and {gather}: no "
            "weight has a precomputed scale (only float8-gathered weights of --recipe "
            f"{', '.join(PRECOMPUTED)} do); drop it"
        )
    if args.emulate and args.device == "cpu" and args.recipe in CPU_EMULATED:
        problems.append(
            f"--emulate changes nothing with --recipe {args.recipe} on --device cpu: its "
            "GEMMs have no CPU kernel and are emulated anyway; drop it (it acts on CUDA)"
        )
    return problems + _skip_problems(args)


def meta_model(args: argparse.Namespace) -> Transformer:
    """The run's model on the meta device (no memory)."""
    with torch.device("meta"):
        return Transformer(build_args(args))


def _skip_problems(args: argparse.Namespace) -> list[str]:
    """A ``--float8-skip`` glob that matches no layer the run would convert."""
    if not args.float8_skip:
        return []
    names = [
        fqn
        for fqn, module in meta_model(args).named_modules()
        if fqn.startswith("blocks.") and isinstance(module, (nn.Linear, GroupedExperts))
    ]
    examples = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return [
        f"--float8-skip {glob!r} matches none of the {len(names)} layers float8 could convert "
        f"(e.g. {examples}); fix the glob (fnmatch, on the full name: 'blocks.0.*', "
        "'*.feed_forward.w2'), or drop it"
        for glob in args.float8_skip
        if not any(fnmatch.fnmatchcase(name, glob) for name in names)
    ]


def block_all_gather_problem(
    args: argparse.Namespace, config, shards: int, *, resuming: bool
) -> str | None:
    """With a block recipe and float8 all-gather, each converted weight's dim-0 shard must
    be whole blocks on ``shards`` shards (the library refuses it at the first all-gather,
    naming no layer). Decided before any process group, naming each layer and the flags
    that run instead (None: every layer fits)."""
    if config is None or not config.enable_fsdp_float8_all_gather or shards == 1:
        return None
    if not config.uses_block_scales():
        return None
    if isinstance(config, NVFP4Config):
        rows = 16  # 16x16 weight tiles
    else:
        rows = config.cast(Operand.WEIGHT, Gemm.OUTPUT).block_shape[0]
    accept = float8_filter(args.float8_skip)
    layers = [
        (fqn, m.out_features)
        for fqn, m in meta_model(args).named_modules()
        if isinstance(m, nn.Linear) and accept(m, fqn)
    ]
    misfits = [(fqn, n) for fqn, n in layers if n % shards or (n // shards) % rows]
    if not misfits:
        return None
    named = ", ".join(f"{fqn} ({n} rows)" for fqn, n in misfits[:6])
    named += ", ..." if len(misfits) > 6 else ""
    globs = sorted({"*." + fqn.split(".", 2)[-1] for fqn, _ in misfits})
    skip = " ".join(f"--float8-skip '{g}'" for g in globs)
    default = " (on by default for this recipe)" if args.fp8_all_gather is None else ""
    resume = " --out holds checkpoints: add --allow-recipe-change to resume with either flag."
    return (
        f"--recipe {args.recipe} with float8 all-gather{default} on {shards} shards: each "
        f"shard of a weight must hold whole {rows}-row blocks (out_features divisible by "
        f"{shards * rows}), and {len(misfits)} of the {len(layers)} converted layers do not: "
        f"{named}. Use --no-fp8-all-gather (weights gathered in high precision, cast after), "
        f"or keep those layers in high precision with {skip}, or a world size on which they "
        f"split into whole blocks (one shard takes any size).{resume if resuming else ''}"
    )
