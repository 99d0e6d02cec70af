"""Flags of ``f8train/train.py`` that would be ignored, refused at argument time.

Mental model: a flag that changes nothing in the run it is given to is a silent bug in the
user's command (``--static-scales input=4`` without ``--scaling static`` used to train with
dynamic scales and report tensorwise/dynamic). ``flag_problems(args)`` lists each such
flag, naming the flag, why it has no effect, and what to do; ``parse_args`` stops on them
with argparse's usage message, before any process group or model exists. The
``--float8-skip`` globs are matched against the model built on the meta device (no
memory, no process group), so a glob that matches no convertible layer is named too.
"""

from __future__ import annotations

import argparse
import fnmatch
from pathlib import Path

import torch
from torch import nn

from f8train.float8_flags import parse_static_scales

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


def flag_problems(args: argparse.Namespace) -> list[str]:
    """One line per flag this run would ignore or cannot read (empty: none)."""
    if args.recipe == "off":
        return [
            f"{flag} has no effect with --recipe off (nothing is converted to float8); "
            "drop it, or choose a float8 --recipe"
            for attr, flag, is_set in _FLOAT8_ONLY
            if is_set(getattr(args, attr))
        ] + _run_problems(args)
    problems = []
    if args.static_scales is not None:
        if args.scaling != "static":
            problems.append(
                f"--static-scales {args.static_scales} is used only with --scaling static "
                f"(this run: --scaling {args.scaling}); add --scaling static, or drop it"
            )
        try:
            parse_static_scales(args.static_scales)
        except ValueError as err:
            problems.append(str(err))
    if args.delayed_history is not None and args.scaling != "delayed":
        problems.append(
            f"--delayed-history {args.delayed_history} is used only with --scaling delayed "
            f"(this run: --scaling {args.scaling}); add --scaling delayed, or drop it"
        )
    if not args.precompute and args.scaling != "dynamic":
        problems.append(
            f"--no-precompute applies to --scaling dynamic only (this run: --scaling "
            f"{args.scaling}, whose sync needs the refresh hook); drop it"
        )
    problems += _skip_problems(args) + _run_problems(args)
    return problems


def _run_problems(args: argparse.Namespace) -> list[str]:
    """Run and data flags that the rest of the command makes idle."""
    problems = []
    if args.token_dtype is not None and (args.data is None or Path(args.data).is_dir()):
        what = "the stdlib corpus" if args.data is None else f"the folder {args.data}"
        problems.append(
            f"--token-dtype {args.token_dtype} applies to a token file, but --data is {what} "
            "(byte-level text); drop --token-dtype, or pass the token file as --data"
        )
    if args.cache_dir is not None and args.data is not None and not Path(args.data).is_dir():
        problems.append(
            f"--cache-dir {args.cache_dir} holds the token cache of a folder or of the stdlib "
            f"corpus, but --data {args.data} is one file, read in place; drop --cache-dir"
        )
    if args.stop_at_step is not None and args.stop_at_step >= args.steps:
        problems.append(
            f"--stop-at-step {args.stop_at_step} is not before --steps {args.steps}, so the "
            "run ends first; use a step below --steps, or drop it"
        )
    return problems


def _skip_problems(args: argparse.Namespace) -> list[str]:
    """A ``--float8-skip`` glob that matches no layer the run would convert."""
    if not args.float8_skip:
        return []
    from f8train.moe import GroupedExperts
    from f8train.sharded_model import Transformer, build_args

    with torch.device("meta"):
        model = Transformer(build_args(args))
    names = [
        fqn
        for fqn, module in model.named_modules()
        if fqn.startswith("blocks.") and isinstance(module, (nn.Linear, GroupedExperts))
    ]
    problems = []
    for glob in args.float8_skip:
        if not any(fnmatch.fnmatchcase(name, glob) for name in names):
            examples = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            problems.append(
                f"--float8-skip {glob!r} matches none of the {len(names)} layers float8 "
                f"could convert (e.g. {examples}); fix the glob (fnmatch, on the full name: "
                "'blocks.0.*', '*.feed_forward.w2'), or drop it"
            )
    return problems


def block_all_gather_problem(
    args: argparse.Namespace, config, shards: int, *, resuming: bool
) -> str | None:
    """With a block recipe and float8 all-gather, every converted weight's dim-0 shard must
    be whole blocks on ``shards`` shards (``check_block_shards``: the library refuses it
    at the first all-gather, naming no layer). Decided here, before any process group,
    naming each layer and the flags that run instead (None: every layer fits)."""
    if config is None or not config.enable_fsdp_float8_all_gather or shards == 1:
        return None
    if not config.uses_block_scales():
        return None
    from f8train.float8_flags import float8_filter
    from f8train.sharded_model import Transformer, build_args
    from fsdp_float8 import Gemm, Operand

    rows = config.cast(Operand.WEIGHT, Gemm.OUTPUT).block_shape[0]
    accept = float8_filter(args.float8_skip)
    with torch.device("meta"):
        model = Transformer(build_args(args))
    layers = [
        (fqn, m.out_features)
        for fqn, m in model.named_modules()
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
    resume = (
        " --out holds checkpoints: add --allow-recipe-change to resume with either flag."
        if resuming
        else ""
    )
    return (
        f"--recipe {args.recipe} with float8 all-gather{default} on {shards} shards: each "
        f"shard of a weight must hold whole {rows}-row blocks (out_features divisible by "
        f"{shards * rows}), and {len(misfits)} of the {len(layers)} converted layers do not: "
        f"{named}. Use --no-fp8-all-gather (weights gathered in high precision, cast after), "
        f"or keep those layers in high precision with {skip}, or a world size on which they "
        f"split into whole blocks (one shard takes any size).{resume}"
    )
