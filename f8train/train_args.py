"""Command-line flags of ``f8train/train.py`` (``python -m f8train.train --help``).

Defaults are the ``make train`` run. ``parse_args`` refuses, before any process group or
model exists, a value out of its range (each numeric type names it), a flag that would do
nothing in this run, a ``--tp`` that cannot run with the rest, and an ``--out`` that is not
a folder that can be written.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

from f8train.data import corpus_tokens, min_corpus_tokens, not_regular, val_tokens
from f8train.float8_flags import NVFP4_RECIPES, RECIPES, SCALINGS, flag_problems
from f8train.model import PRESETS, build_args
from f8train.token_batches import val_batches_available
from f8train.token_cache import CACHE_ENV, default_cache_dir


def number(kind: type, low: float, high: float = math.inf, *, strict: bool = False) -> Callable:
    """An argparse type: a finite ``kind`` (int or float) in [low, high] (``strict``: in
    (low, high)); its error message names the range."""
    word = "an integer" if kind is int else "a number"
    lo, hi = (str(low), str(high)) if kind is int else (f"{low:g}", f"{high:g}")
    if math.isinf(high):
        bound = f"{'>' if strict else '>='} {lo}"
    else:
        bound = f"in ({lo}, {hi})" if strict else f">= {lo} and <= {hi}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        fits = low < value < high if strict else low <= value <= high
        if not (math.isfinite(value) and fits):
            raise argparse.ArgumentTypeError(f"expected {word} {bound}, got {text!r}")
        return value

    return parse


DEFAULT_DELAYED_HISTORY = 16
DEFAULT_OUT = "runs/train-"  # + the recipe: a baseline never meets the float8 run's checkpoint
_SHAPE = ("dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of")
POS_INT, NONNEG_INT = number(int, 1), number(int, 0)
SEED = number(int, 0, 2**64 - 1)  # what torch.manual_seed takes
POS_FLOAT, NONNEG_FLOAT = number(float, 0, strict=True), number(float, 0)
FRACTION = number(float, 0, 1, strict=True)
FLAG, BOOL, HIDDEN = "store_true", argparse.BooleanOptionalAction, argparse.SUPPRESS
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# group -> rows of (flag, type / action / choices, default, help[, metavar]); docs/trainer.md
# tells what each does
_FLAGS: dict[str, list[tuple]] = {
    "model": [
        ("--preset", tuple(sorted(PRESETS)), "tiny", None),
        ("--dim", POS_INT, None, "override the preset's model dim"),
        ("--n-layers", POS_INT, None, None),
        ("--n-heads", POS_INT, None, None),
        ("--n-kv-heads", POS_INT, None, None),
        ("--multiple-of", POS_INT, None, "round the MLP hidden dim up to this"),
    ],
    "float8": [
        ("--recipe", RECIPES, "tensorwise", "off: high-precision baseline"),
        ("--scaling", SCALINGS, "dynamic", "delayed/static: tensorwise only"),
        ("--fp8-all-gather", BOOL, None, "float8 all-gather (default: tensorwise, mxfp8)"),
        ("--precompute", BOOL, True, "one scale collective per step (else one per weight)"),
        ("--delayed-history", POS_INT, None, f"amax history (default {DEFAULT_DELAYED_HISTORY})"),
        ("--static-scales", None, None, "e.g. input=64,weight=2048,grad_output=1048576"),
        ("--float8-skip", "append", [], "fqn glob kept in high precision (repeatable)", "GLOB"),
        ("--emulate", FLAG, False, "emulated float8/NVFP4 GEMMs (GPUs without them)"),
        ("--float8-reduce-scatter", FLAG, False, "reduce-scatter gradients in float8"),
        ("--numerics-every", NONNEG_INT, 0, "sample float8 numerics every N steps", "N"),
    ],
    "parallelism and precision": [
        ("--device", ("cpu", "cuda"), DEVICE, None),
        ("--hsdp-replicate", POS_INT, 1, "HSDP: N replicas x (world / N) shards"),
        ("--tp", POS_INT, 1, "tensor parallel size (f8train/tp_plan.py), FSDP2 over the rest"),
        ("--mixed-precision", ("bf16", "none"), "bf16", None),
        ("--activation-checkpointing", FLAG, False, None),
        ("--compile", FLAG, False, "torch.compile each block"),
    ],
    "optimization": [
        ("--steps", POS_INT, 100, None),
        ("--global-batch", POS_INT, 16, "sequences per step"),
        ("--seq-len", POS_INT, 128, None),
        ("--lr", POS_FLOAT, 3e-3, "peak learning rate"),
        ("--warmup", NONNEG_INT, None, "linear warmup steps (default: steps // 10)"),
        ("--min-lr-ratio", number(float, 0, 1), 0.1, "cosine decays to lr * this"),
        ("--weight-decay", NONNEG_FLOAT, 0.1, None),
        ("--grad-clip", NONNEG_FLOAT, 1.0, "max grad norm; 0: no clipping"),
        ("--seed", SEED, 0, None),
    ],
    "run, logging, checkpoints": [
        ("--out", None, None, f"metrics, summary, checkpoints; None: {DEFAULT_OUT}RECIPE"),
        ("--log-every", POS_INT, 10, "progress line (non-terminal)"),
        ("--val-every", NONNEG_INT, 25, "0: no validation"),
        ("--val-batches", POS_INT, 4, None),
        ("--comm-every", NONNEG_INT, None, "count collectives (default: 1, 10 on CUDA)"),
        ("--peak-tflops", POS_FLOAT, None, "per-device peak for MFU"),
        ("--ckpt-every", NONNEG_INT, 50, "0: only at the end"),
        ("--keep-ckpts", POS_INT, 2, "newest checkpoints kept"),
        ("--resume", "?", None, "CKPT, or the latest checkpoint in --out", "CKPT"),
        ("--allow-recipe-change", FLAG, False, "resume with another --recipe (not delayed)"),
        ("--allow-batch-change", FLAG, False, "resume with another --global-batch"),
        # long enough for a checkpoint save or a first compiled step on a slow rank, short
        # enough that a hung job ends well before torch's default 30 minutes
        ("--pg-timeout-s", POS_FLOAT, 300.0, "end a collective waiting this long"),
        ("--auto-resume", BOOL, True, "continue from the latest checkpoint in --out"),
        ("--stop-at-step", POS_INT, None, "save and exit after step K"),
        ("--crash-at-step", POS_INT, None, HIDDEN),  # test hooks
        ("--nan-at-step", POS_INT, None, HIDDEN),
        ("--hang-at-step", POS_INT, None, HIDDEN),
    ],
    "data": [
        ("--data", None, None, "text file, folder, or .u16.bin/.u32.bin (default: stdlib)"),
        ("--cache-dir", None, None, f"token cache; None: ${CACHE_ENV} or {default_cache_dir()}"),
        ("--token-dtype", ("uint16", "uint32"), None, None),
        ("--val-fraction", FRACTION, 0.01, "the share of the tokens held out for validation"),
    ],
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchrun --standalone --nproc_per_node N -m f8train.train",
        description="Float8 pretraining under FSDP2 (see the module docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for title, rows in _FLAGS.items():
        group = parser.add_argument_group(title)
        for flag, kind, default, text, *metavar in rows:
            kw = {"default": default, "help": text} | ({"metavar": metavar[0]} if metavar else {})
            if isinstance(kind, tuple):
                kw["choices"] = kind
            elif kind == "?":
                kw.update(nargs="?", const="latest")
            elif isinstance(kind, str) or kind is BOOL:
                kw["action"] = kind
            elif kind is not None:
                kw["type"] = kind
            group.add_argument(flag, **kw)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = f"{DEFAULT_OUT}{args.recipe}"
    if args.comm_every is None:
        args.comm_every = 0 if args.compile else 10 if args.device == "cuda" else 1
    if (problem := shape_problem(args)) is not None:  # the other checks build the model
        parser.error(problem)
    problems = flag_problems(args) + _run_problems(args)
    if (problem := data_problem(args)) is not None:
        problems.append(f"argument --data: {problem}")
    if (problem := tp_problem(args)) is not None:
        problems.append(f"argument --tp: {problem}")
    if (problem := out_problem(args.out)) is not None:
        problems.append(f"argument --out: {problem}; choose a folder you can write to")
    if problems:
        parser.error("\n".join(problems))
    resolve_defaults(args)
    return args


def resolve_defaults(args: argparse.Namespace) -> None:
    """Defaults that are None at parse time, so that a flag given in vain can be told from
    one not given."""
    if args.delayed_history is None:
        args.delayed_history = DEFAULT_DELAYED_HISTORY


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
    if args.warmup is not None and args.warmup >= args.steps:
        problems.append(
            f"argument --warmup: --warmup {args.warmup} is not below --steps {args.steps}, so "
            f"the learning rate never reaches --lr {args.lr:g}; use a --warmup below --steps, "
            "or drop it (default: steps // 10)"
        )
    for flag in ("allow_recipe_change", "allow_batch_change"):
        if getattr(args, flag) and args.resume is None and not args.auto_resume:
            problems.append(
                f"--{flag.replace('_', '-')} applies to a resumed run, but --no-auto-resume "
                "without --resume never resumes; drop it, or add --resume"
            )
    if args.stop_at_step is not None and args.stop_at_step >= args.steps:
        problems.append(
            f"--stop-at-step {args.stop_at_step} is not before --steps {args.steps}, so the "
            "run ends first; use a step below --steps, or drop it"
        )
    return problems


def shape_problem(args: argparse.Namespace) -> str | None:
    """Why the model shape flags cannot build a model (None: they can), under the flags
    given."""
    try:
        build_args(args)
    except ValueError as err:
        flags = [f"--{k.replace('_', '-')}" for k in _SHAPE if getattr(args, k) is not None]
        return f"argument {' / '.join(flags) or '--preset'}: {err}"
    return None


def data_problem(args: argparse.Namespace) -> str | None:
    """Why ``--data`` cannot train with these flags (None: it can), from the file sizes:
    a path that is not a regular file or folder, or a validation split too small for
    ``--val-batches`` batches of ``--global-batch`` x ``--seq-len``."""
    if args.data is not None and (problem := not_regular(Path(args.data))) is not None:
        return problem
    n = corpus_tokens(args.data, args.token_dtype)
    if n is None:
        return None
    shape = dict(seq_len=args.seq_len, global_batch=args.global_batch)
    need = min_corpus_tokens(val_fraction=args.val_fraction, val_batches=args.val_batches, **shape)
    if n >= need:
        return None
    val = val_tokens(n, args.val_fraction)
    name = "the stdlib corpus" if args.data is None else args.data
    return (
        f"{name} holds {n:,} tokens: its validation split (--val-fraction "
        f"{args.val_fraction:g}) is {val:,} tokens, {val_batches_available(val, **shape)} "
        f"batches of --global-batch {args.global_batch} x (--seq-len {args.seq_len} + 1) "
        f"tokens, but --val-batches {args.val_batches} were asked for (and the training split "
        f"needs {args.seq_len + 1} tokens). With these flags the corpus needs at least "
        f"{need:,} tokens (bytes of text); or raise --val-fraction, or lower --val-batches, "
        "--global-batch or --seq-len"
    )


def tp_problem(args: argparse.Namespace) -> str | None:
    """Why ``--tp`` cannot run with the other flags (None: it can)."""
    if args.tp == 1:
        return None
    if args.seq_len % args.tp:
        return f"--seq-len {args.seq_len} is not a multiple of --tp {args.tp} (sequence parallel)"
    if args.recipe != "off" and args.scaling == "delayed":
        return "delayed scaling is not supported under tensor parallelism; use --scaling dynamic"
    if args.recipe in NVFP4_RECIPES:
        return (
            f"--recipe {args.recipe} is not supported under tensor parallelism (NVFP4 layers have no "
            "tensor-parallel sharding); use --recipe tensorwise, rowwise or rowwise_with_gw_hp "
            "with --tp, or drop --tp"
        )
    if args.recipe in ("blockwise", "mxfp8"):
        return (
            f"--recipe {args.recipe} (block scales) is not supported under tensor parallelism "
            "yet; use --recipe tensorwise, rowwise or rowwise_with_gw_hp"
        )
    if PRESETS[args.preset].moe is not None:
        return f"--preset {args.preset} has mixture-of-experts blocks, which the TP plan lacks"
    if args.compile:
        return "--compile with --tp is not supported yet (not tested); drop --compile"
    return None


def out_problem(out: str) -> str | None:
    """Why ``out`` cannot be written (None: it can): it or its checkpoint folder must be
    writable folders, or the nearest existing parent must be, so that it can be created."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        return f"{out} is a file, not a folder"
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, so {out} cannot be created under it"
    for folder in (existing, path / "checkpoints"):
        if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
            return f"no permission to write in {folder}"
    return None


def batch_split_problem(global_batch: int, data_parallel: int, *, resuming: bool) -> str | None:
    """Why ``--global-batch`` cannot be split evenly over the data-parallel ranks (every rank
    reads the same number of rows), with the nearest batches that can; on a resume, also how
    to continue a run saved on another world size."""
    if global_batch % data_parallel == 0:
        return None
    lower = global_batch // data_parallel * data_parallel
    near = " or ".join(str(n) for n in (lower, lower + data_parallel) if n > 0)
    text = (
        f"--global-batch {global_batch} is not divisible by the {data_parallel} data-parallel "
        f"ranks (world size / --tp / ...): choose a multiple of {data_parallel}, e.g. {near}"
    )
    if resuming:
        text += (
            ", and add --allow-batch-change to resume a checkpoint saved with another "
            "--global-batch (from the resumed step on, each step draws the new number of "
            "sequences; the step count, learning-rate schedule and token count carry on), or "
            "resume on a world size that divides the saved --global-batch"
        )
    return text
