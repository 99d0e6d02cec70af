"""Command-line flags of ``scripts/train.py`` (``python -m scripts.train --help``).

Defaults are the ``make train`` run: 2 CPU ranks, the tiny preset, float8 tensorwise with
float8 all-gather and precomputed scales, bf16 mixed precision, a few minutes on a CPU.
"""

from __future__ import annotations

import argparse

import torch

from scripts.data import add_data_args
from scripts.float8_flags import RECIPES, SCALINGS
from scripts.model import PRESETS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchrun --standalone --nproc_per_node N -m scripts.train",
        description="Float8 pretraining under FSDP2 (see the module docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _model_args(parser.add_argument_group("model"))
    _float8_args(parser.add_argument_group("float8"))
    _parallel_args(parser.add_argument_group("parallelism and precision"))
    _optim_args(parser.add_argument_group("optimization"))
    _run_args(parser.add_argument_group("run, logging, checkpoints"))
    add_data_args(parser.add_argument_group("data"))
    return parser


def _model_args(g) -> None:
    g.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    g.add_argument("--dim", type=int, default=None, help="override the preset's model dim")
    g.add_argument("--n-layers", type=int, default=None)
    g.add_argument("--n-heads", type=int, default=None)
    g.add_argument("--n-kv-heads", type=int, default=None)
    g.add_argument(
        "--multiple-of", type=int, default=None, help="round the MLP hidden dim up to this"
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
        help="FSDP2 all-gathers converted weights in float8 (default: on for tensorwise, "
        "off for the rowwise recipes unless asked for)",
    )
    g.add_argument(
        "--precompute",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one batched amax all-reduce per step for the float8 all-gather's weight "
        "scales (tensorwise dynamic scaling with --fp8-all-gather only)",
    )
    g.add_argument("--delayed-history", type=int, default=16, help="amax history length")
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
        type=int,
        default=0,
        metavar="N",
        help="sample per-layer float8 numerics (amax, scale, saturation, underflow) every N "
        "steps into OUT/numerics.jsonl (0: off); plot with scripts.plot_numerics",
    )


def _parallel_args(g) -> None:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    g.add_argument("--device", default=default_device, choices=["cpu", "cuda"])
    g.add_argument(
        "--hsdp-replicate",
        type=int,
        default=1,
        help="HSDP: a 2-D mesh of N replicas x (world / N) shards",
    )
    g.add_argument("--mixed-precision", default="bf16", choices=["bf16", "none"])
    g.add_argument("--activation-checkpointing", action="store_true")
    g.add_argument("--compile", action="store_true", help="torch.compile each block")


def _optim_args(g) -> None:
    g.add_argument("--steps", type=int, default=100)
    g.add_argument("--global-batch", type=int, default=16, help="sequences per step")
    g.add_argument("--seq-len", type=int, default=128)
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument(
        "--warmup", type=int, default=None, help="linear warmup steps (default: steps // 10)"
    )
    g.add_argument(
        "--min-lr-ratio", type=float, default=0.1, help="cosine decays to lr * this at the end"
    )
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0, help="max grad norm; 0: no clipping")
    g.add_argument("--seed", type=int, default=0)


def _run_args(g) -> None:
    g.add_argument("--out", default="runs/train", help="metrics, summary and checkpoints")
    g.add_argument("--log-every", type=int, default=10, help="progress line (non-terminal)")
    g.add_argument("--val-every", type=int, default=25, help="0: no validation")
    g.add_argument("--val-batches", type=int, default=4)
    g.add_argument(
        "--comm-every",
        type=int,
        default=None,
        help="count collectives every N steps (default: 1 on CPU, 10 on CUDA, 0 with "
        "--compile: the counter is a TorchDispatchMode, under which compiled blocks run "
        "eagerly); 0: never",
    )
    g.add_argument("--peak-tflops", type=float, default=None, help="per-device peak for MFU")
    g.add_argument("--ckpt-every", type=int, default=50, help="0: only at the end")
    g.add_argument("--keep-ckpts", type=int, default=2, help="newest checkpoints kept")
    g.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="CKPT",
        help="resume from CKPT, or from the latest checkpoint in --out",
    )
    g.add_argument(
        "--auto-resume",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="continue from the latest checkpoint in --out when there is one",
    )
    g.add_argument("--stop-at-step", type=int, default=None, help="save and exit after step K")
    # test hooks, hidden from --help
    g.add_argument("--crash-at-step", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--nan-at-step", type=int, default=None, help=argparse.SUPPRESS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.comm_every is None:
        args.comm_every = 0 if args.compile else 10 if args.device == "cuda" else 1
    for name in ("steps", "global_batch", "seq_len", "keep_ckpts"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    return args
