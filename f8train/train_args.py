"""Command-line flags of ``f8train/train.py`` (``python -m f8train.train --help``).

Defaults are the ``make train`` run: 2 CPU ranks, the tiny preset, float8 tensorwise with
float8 all-gather and precomputed scales, bf16 mixed precision, a few minutes on a CPU.

Every numeric flag is parsed by a type function that states its range, so a bad value
stops at once with argparse's ``argument --warmup: expected an integer >= 0, got '-5'``;
``--out`` is checked for being a writable folder (or creatable in one) at the same time,
before any process group or model exists.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

from f8train.data import default_cache_dir
from f8train.flag_checks import flag_problems
from f8train.float8_flags import RECIPES, SCALINGS
from f8train.model import PRESETS
from f8train.process_group import DEFAULT_TIMEOUT_S


def number(kind: type, low: float, *, above: bool = False, high: float | None = None) -> Callable:
    """An argparse type: ``kind`` (int or float) ``>= low`` (``> low`` with ``above``),
    ``<= high`` when given; finite. Its error message names the expected range."""
    word = "an integer" if kind is int else "a number"
    bound = f"{'>' if above else '>='} {low:g}" + (f" and <= {high:g}" if high is not None else "")

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {word} {bound}, got {text!r}") from None
        fits = (value > low if above else value >= low) and (high is None or value <= high)
        if not (math.isfinite(value) and fits):
            raise argparse.ArgumentTypeError(f"expected {word} {bound}, got {text!r}")
        return value

    parse.__name__ = f"{kind.__name__} {bound}"
    return parse


DEFAULT_DELAYED_HISTORY = 16
POS_INT = number(int, 1)
NONNEG_INT = number(int, 0)
POS_FLOAT = number(float, 0, above=True)
NONNEG_FLOAT = number(float, 0)
RATIO = number(float, 0, high=1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchrun --standalone --nproc_per_node N -m f8train.train",
        description="Float8 pretraining under FSDP2 (see the module docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _model_args(parser.add_argument_group("model"))
    _float8_args(parser.add_argument_group("float8"))
    _parallel_args(parser.add_argument_group("parallelism and precision"))
    _optim_args(parser.add_argument_group("optimization"))
    _run_args(parser.add_argument_group("run, logging, checkpoints"))
    _data_args(parser.add_argument_group("data"))
    return parser


def _model_args(g) -> None:
    g.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    g.add_argument("--dim", type=POS_INT, default=None, help="override the preset's model dim")
    g.add_argument("--n-layers", type=POS_INT, default=None)
    g.add_argument("--n-heads", type=POS_INT, default=None)
    g.add_argument("--n-kv-heads", type=POS_INT, default=None)
    g.add_argument(
        "--multiple-of", type=POS_INT, default=None, help="round the MLP hidden dim up to this"
    )


def _float8_args(g) -> None:
    g.add_argument(
        "--recipe", default="tensorwise", choices=RECIPES, help="off: high-precision baseline"
    )
    g.add_argument(
        "--scaling", default="dynamic", choices=SCALINGS, help="delayed/static: tensorwise only"
    )
    g.add_argument(
        "--fp8-all-gather",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="FSDP2 all-gathers converted weights in float8 (default: on for tensorwise and "
        "mxfp8, off for the rowwise recipes and blockwise unless asked for)",
    )
    g.add_argument(
        "--precompute",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the float8 refresh hook: one collective per step for the float8 "
        "all-gather's weight scales (--no-precompute removes it for dynamic scaling: each "
        "weight all-reduces its own amax)",
    )
    g.add_argument(
        "--delayed-history",
        type=POS_INT,
        default=None,
        help=f"amax history length (--scaling delayed; default {DEFAULT_DELAYED_HISTORY})",
    )
    g.add_argument(
        "--static-scales",
        default=None,
        help="static scales, e.g. input=64,weight=2048,grad_output=1048576 (the defaults)",
    )
    g.add_argument(
        "--float8-skip",
        action="append",
        default=[],
        metavar="GLOB",
        help="keep block linears matching this fqn glob in high precision (repeatable), "
        "e.g. 'blocks.0.*'",
    )
    g.add_argument(
        "--emulate", action="store_true", help="emulated float8 GEMMs (GPUs without float8)"
    )
    g.add_argument(
        "--float8-reduce-scatter",
        action="store_true",
        help="reduce-scatter gradients in block-scaled float8 (one uint8 all-to-all)",
    )
    g.add_argument(
        "--numerics-every",
        type=NONNEG_INT,
        default=0,
        metavar="N",
        help="sample per-layer float8 numerics (amax, scale, saturation, underflow) every N "
        "steps into OUT/numerics.jsonl (0: off); plot with f8train.plot_numerics",
    )


def _parallel_args(g) -> None:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    g.add_argument("--device", default=default_device, choices=["cpu", "cuda"])
    g.add_argument(
        "--hsdp-replicate",
        type=POS_INT,
        default=1,
        help="HSDP: a 2-D mesh of N replicas x (world / N) shards",
    )
    g.add_argument(
        "--tp",
        type=POS_INT,
        default=1,
        help="tensor parallel size: a (data parallel, N) mesh, the Llama TP plan of "
        "f8train/tp_plan.py (sequence parallel) over the N ranks, FSDP2 over the rest",
    )
    g.add_argument("--mixed-precision", default="bf16", choices=["bf16", "none"])
    g.add_argument("--activation-checkpointing", action="store_true")
    g.add_argument("--compile", action="store_true", help="torch.compile each block")


def _optim_args(g) -> None:
    g.add_argument("--steps", type=POS_INT, default=100)
    g.add_argument("--global-batch", type=POS_INT, default=16, help="sequences per step")
    g.add_argument("--seq-len", type=POS_INT, default=128)
    g.add_argument("--lr", type=POS_FLOAT, default=3e-3, help="peak learning rate")
    g.add_argument(
        "--warmup", type=NONNEG_INT, default=None, help="linear warmup steps (default: steps // 10)"
    )
    g.add_argument(
        "--min-lr-ratio", type=RATIO, default=0.1, help="cosine decays to lr * this at the end"
    )
    g.add_argument("--weight-decay", type=NONNEG_FLOAT, default=0.1)
    g.add_argument(
        "--grad-clip", type=NONNEG_FLOAT, default=1.0, help="max grad norm; 0: no clipping"
    )
    g.add_argument("--seed", type=NONNEG_INT, default=0)


def _run_args(g) -> None:
    g.add_argument("--out", default="runs/train", help="metrics, summary and checkpoints")
    g.add_argument("--log-every", type=POS_INT, default=10, help="progress line (non-terminal)")
    g.add_argument("--val-every", type=NONNEG_INT, default=25, help="0: no validation")
    g.add_argument("--val-batches", type=POS_INT, default=4)
    g.add_argument(
        "--comm-every",
        type=NONNEG_INT,
        default=None,
        help="count collectives every N steps (default: 1 on CPU, 10 on CUDA, 0 with "
        "--compile: the counter is a TorchDispatchMode, under which compiled blocks run "
        "eagerly); 0: never",
    )
    g.add_argument("--peak-tflops", type=POS_FLOAT, default=None, help="per-device peak for MFU")
    g.add_argument("--ckpt-every", type=NONNEG_INT, default=50, help="0: only at the end")
    g.add_argument("--keep-ckpts", type=POS_INT, default=2, help="newest checkpoints kept")
    g.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="CKPT",
        help="resume from CKPT, or from the latest checkpoint in --out",
    )
    g.add_argument(
        "--allow-recipe-change",
        action="store_true",
        help="resume a checkpoint saved with another --recipe / --fp8-all-gather / "
        "--float8-skip (not with delayed scaling on either side); other changes to the "
        "settings a checkpoint depends on are refused",
    )
    g.add_argument(
        "--pg-timeout-s",
        type=POS_FLOAT,
        default=DEFAULT_TIMEOUT_S,
        help="a collective waiting longer than this for its peers ends the run with a message",
    )
    g.add_argument(
        "--auto-resume",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="continue from the latest checkpoint in --out when there is one",
    )
    g.add_argument("--stop-at-step", type=POS_INT, default=None, help="save and exit after step K")
    # test hooks, hidden from --help
    g.add_argument("--crash-at-step", type=POS_INT, default=None, help=argparse.SUPPRESS)
    g.add_argument("--nan-at-step", type=POS_INT, default=None, help=argparse.SUPPRESS)
    g.add_argument("--hang-at-step", type=POS_INT, default=None, help=argparse.SUPPRESS)


def _data_args(g) -> None:
    g.add_argument(
        "--data",
        default=None,
        help="text file, folder of text files, or .u16.bin/.u32.bin token file "
        "(default: the Python stdlib sources)",
    )
    g.add_argument("--cache-dir", default=None, help=f"default {default_cache_dir()}")
    g.add_argument("--token-dtype", default=None, choices=["uint16", "uint32"])
    g.add_argument("--val-fraction", type=_fraction, default=0.01, help="in (0, 1)")


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.comm_every is None:
        args.comm_every = 0 if args.compile else 10 if args.device == "cuda" else 1
    problems = flag_problems(args)
    if problems:
        parser.error("\n".join(problems))
    resolve_defaults(args)
    problem = tp_problem(args)
    if problem is not None:
        parser.error(f"argument --tp: {problem}")
    problem = out_problem(args.out)
    if problem is not None:
        parser.error(f"argument --out: {problem}; choose a folder you can write to")
    return args


def resolve_defaults(args: argparse.Namespace) -> None:
    """Defaults that are None at parse time so that a flag given in vain can be told from
    one not given (``f8train/flag_checks.py``)."""
    if args.delayed_history is None:
        args.delayed_history = DEFAULT_DELAYED_HISTORY


def tp_problem(args: argparse.Namespace) -> str | None:
    """Why ``--tp`` cannot run with the other flags (None: it can)."""
    if args.tp == 1:
        return None
    if args.seq_len % args.tp:
        return f"--seq-len {args.seq_len} is not a multiple of --tp {args.tp} (sequence parallel)"
    if args.recipe != "off" and args.scaling == "delayed":
        return "delayed scaling is not supported under tensor parallelism; use --scaling dynamic"
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
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, so {out} cannot be created under it"
    for folder in (existing, path / "checkpoints"):
        if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
            return f"no permission to write in {folder}"
    return None
