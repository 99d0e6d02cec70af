"""Setup pieces of ``scripts/train.py``: process group and mesh, float8 config, the sharded
model, the optimizer and its LR schedule.

Mental model of the model build (``build_model``), in the order torchtitan uses:

    Transformer on the meta device -> float8 swap of the block linears -> activation
    checkpointing per block -> torch.compile per block -> fully_shard per block, then the
    root -> to_empty(device) -> init_weights(seed)

Each rank therefore only ever allocates its own shards, and ``init_weights`` gives the same
values for any world size or mesh shape (see ``scripts/model.py``).
"""

from __future__ import annotations

import argparse
import faulthandler
import fnmatch
import math
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdp_float8 import (
    CastConfig,
    DelayedScalingConfig,
    Float8LinearConfig,
    convert_to_float8_training,
    enable_float8_reduce_scatter,
)
from fsdp_float8.convert import dims_divisible_by_16
from scripts.model import Transformer, model_args

RECIPES = ("off", "tensorwise", "rowwise", "rowwise_with_gw_hp")
SCALINGS = ("dynamic", "delayed", "static")
# static scales multiply hp values into float8 range: roughly fp8_max / expected amax
DEFAULT_STATIC_SCALES = {"input": 64.0, "weight": 2048.0, "grad_output": 2.0**20}


@dataclass(frozen=True)
class Dist:
    """Where this process sits: rank, world size, device and the data-parallel mesh."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str, hsdp_replicate: int) -> Dist:
    """Init the process group (gloo on CPU, NCCL on CUDA) and an explicit device mesh.

    Under torchrun the rendezvous comes from the environment; started as a plain
    ``python -m scripts.train`` it runs as a single rank with an in-memory store.
    """
    if device_type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False; use --device cpu")
    backend = "nccl" if device_type == "cuda" else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    device_id = device if device_type == "cuda" else None
    if "RANK" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    elif _restarted_on_agent_store():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.PrefixStore(f"scripts.train/attempt_{_restart_count()}", _agent_store(world))
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, device_id=device_id
        )
    else:
        dist.init_process_group(backend, device_id=device_id)
    world = dist.get_world_size()
    mesh = _data_parallel_mesh(device_type, world, hsdp_replicate)
    return Dist(dist.get_rank(), world, local_rank, device, mesh)


def enable_crash_traces() -> None:
    """On SIGSEGV/SIGABRT/SIGBUS/SIGFPE print every Python thread's stack to stderr, so a
    rank that dies in C++ (a collective, a kernel, teardown) says where it was."""
    if sys.__stderr__ is not None:  # the process's own stderr, not a test's capture of it
        faulthandler.enable(file=sys.__stderr__, all_threads=True)


def exit_rank(code: int) -> NoReturn:
    """End a launched rank after ``dist.destroy_process_group()``: flush stdout and stderr,
    then ``os._exit(code)``, skipping interpreter finalization.

    Why: destroying the process group unregisters it, but FSDP state, the device mesh and
    reference cycles keep the C++ process group alive, and its worker threads (gloo's
    runLoop, NCCL's watchdog) may still be dropping their last collectives' tensors when the
    main thread returns. Freeing a tensor whose Python object C++ kept alive needs the GIL;
    a thread that asks for the GIL while Python finalizes is ended with ``pthread_exit``,
    which aborts from a destructor ("terminate called without an active exception",
    SIGABRT). torchrun then reports the finished run as failed (and with ``--max-restarts``
    restarts it). CI saw this once on rank 1 of a 2-step CPU run after every output was
    written. The callers close every file they write before this point (metrics are
    appended with a ``with`` block per line), so nothing is lost by skipping finalization.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _restarted_on_agent_store() -> bool:
    # torch 2.13: torchrun's workers share the agent's TCPStore with no per-attempt key
    # prefix, so after a restart gloo reads the previous attempt's peer addresses and fails
    # with "Connection refused" (pytorch/pytorch#135712 is the NCCL face of it). Give each
    # attempt its own prefix. TORCHELASTIC_RESTART_COUNT is consistent among the workers of
    # one agent; multi-node restarts should set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    # (a fresh store per round), which also turns this path off.
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and _restart_count() > 0


def _agent_store(world: int) -> dist.Store:
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timedelta(minutes=10),
    )


def _data_parallel_mesh(device_type: str, world: int, replicate: int) -> DeviceMesh:
    if replicate < 1 or world % replicate != 0:
        raise SystemExit(
            f"--hsdp-replicate {replicate} with {world} ranks: expected a divisor of the world "
            f"size (replicate x shard = {world})"
        )
    if replicate == 1:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(
        device_type, (replicate, world // replicate), mesh_dim_names=("replicate", "shard")
    )


def float8_config(args: argparse.Namespace) -> Float8LinearConfig | None:
    """The float8 config the flags ask for (None for ``--recipe off``); exits with the
    config's own message when the combination is refused."""
    if args.recipe == "off":
        return None
    all_gather = args.fp8_all_gather
    if all_gather is None:  # default: on where the recipe allows it
        all_gather = args.recipe == "tensorwise"
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
        hint = ""
        if all_gather and args.recipe != "tensorwise":
            hint = (
                f"\nfloat8 all-gather is not supported with --recipe {args.recipe} yet "
                "(rowwise weights are scaled per row along the dim FSDP shards); "
                "drop --fp8-all-gather"
            )
        raise SystemExit(f"float8 config refused: {err}{hint}") from None


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
    """``"input=64,weight=2048"`` -> scales per operand, defaults for the rest."""
    scales = dict(DEFAULT_STATIC_SCALES)
    for item in filter(None, (text or "").split(",")):
        name, _, value = item.partition("=")
        if name.strip() not in scales or not value:
            raise SystemExit(
                f"--static-scales item {item!r}; expected NAME=VALUE with NAME in "
                f"{sorted(scales)}, e.g. input=64,weight=2048,grad_output=1048576"
            )
        scales[name.strip()] = float(value)
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


def build_args(args: argparse.Namespace):
    overrides = {
        k: getattr(args, k)
        for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of")
        if getattr(args, k) is not None
    }
    return model_args(args.preset, max_seq_len=args.seq_len, **overrides)


def build_model(
    args: argparse.Namespace, d: Dist, config: Float8LinearConfig | None
) -> tuple[Transformer, object]:
    """The sharded, initialized model and its float8 conversion report (None if off)."""
    with torch.device("meta"):
        model = Transformer(build_args(args))
    report = None
    if config is not None:
        convert_to_float8_training(
            model, config=config, module_filter_fn=float8_filter(args.float8_skip)
        )
        report = model.float8_conversion_report
    _wrap_blocks(model, args)
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if args.mixed_precision == "bf16" else None,
        reduce_dtype=torch.float32,
    )
    for block in model.blocks:
        fully_shard(block, mesh=d.mesh, mp_policy=mp)
    fully_shard(model, mesh=d.mesh, mp_policy=mp)
    if args.float8_reduce_scatter:
        enable_float8_reduce_scatter(model)
    model.to_empty(device=d.device)
    model.init_weights(args.seed)  # Float8Linear resets its delayed buffers in to_empty
    return model, report


def _wrap_blocks(model: Transformer, args: argparse.Namespace) -> None:
    for i, block in enumerate(model.blocks):
        if args.activation_checkpointing:
            block = checkpoint_wrapper(block)
        if args.compile:
            block.compile()  # in place: parameter names stay as they are
        model.blocks[i] = block


def conversion_counts(model: nn.Module, report) -> dict[str, int]:
    """Global parameter counts: float8-converted linear weights vs everything else."""
    names = set(report.converted) if report is not None else set()
    converted = other = 0
    for fqn, p in model.named_parameters():
        fqn = fqn.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        if fqn.removesuffix(".weight") in names:
            converted += p.numel()
        else:
            other += p.numel()
    return {"float8_params": converted, "high_precision_params": other}


def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (norm weights are not decayed)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)


@dataclass(frozen=True)
class WarmupCosine:
    """LR multiplier: linear warmup over ``warmup`` steps, then cosine decay to
    ``min_ratio`` at ``total``. A callable object, so LambdaLR's state_dict keeps it."""

    warmup: int
    total: int
    min_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, args: argparse.Namespace):
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    fn = WarmupCosine(warmup=warmup, total=args.steps, min_ratio=args.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def describe(a: argparse.Namespace) -> str:
    """One line naming the configuration, e.g. 'tensorwise/dynamic fp8-all-gather bf16'."""
    if a.recipe == "off":
        parts = ["off"]
    else:
        parts = [f"{a.recipe}/{a.scaling}"]
        all_gather = a.fp8_all_gather if a.fp8_all_gather is not None else a.recipe == "tensorwise"
        parts.append("fp8-all-gather" if all_gather else "hp-all-gather")
        if all_gather and a.scaling == "dynamic" and a.recipe == "tensorwise":
            parts.append("precompute" if a.precompute else "no-precompute")
    parts.append(a.mixed_precision)
    if a.hsdp_replicate > 1:
        parts.append(f"hsdp-replicate={a.hsdp_replicate}")
    parts += [flag for flag in ("activation_checkpointing", "compile") if getattr(a, flag)]
    return " ".join(parts)


def check_vocab(data_vocab: int | None, model_vocab: int) -> None:
    if data_vocab is not None and data_vocab > model_vocab:
        raise SystemExit(
            f"the data has a vocabulary of {data_vocab} but the model's is {model_vocab}; "
            "pick a --preset whose vocab_size covers the data"
        )
