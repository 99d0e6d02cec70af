"""The sharded model of ``f8train/train.py``.

Mental model of the model build (``build_model``), in the order torchtitan uses:

    Transformer on the meta device -> float8 swap of the block linears -> the tensor-
    parallel plan (``--tp``, ``f8train/tp_plan.py``) -> activation checkpointing per block
    -> torch.compile per block -> fully_shard per block, then the root -> to_empty(device)
    -> init_weights(seed)

Each rank therefore only ever allocates its own shards, and ``init_weights`` gives the same
values for any world size or mesh shape (see ``f8train/model.py``).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from f8train.float8_flags import expert_filter, float8_filter
from f8train.model import Transformer, model_args
from f8train.process_group import Dist
from f8train.tp_plan import apply_tensor_parallel
from fsdp_float8 import Float8LinearConfig, convert_to_float8_training, enable_float8_reduce_scatter


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
            model,
            config=config,
            module_filter_fn=float8_filter(args.float8_skip),
            expert_filter_fn=expert_filter(args.float8_skip),
        )
        report = model.float8_conversion_report
    if d.tp_mesh is not None:  # after the float8 swap, before the wrappers and fully_shard
        apply_tensor_parallel(model, d.tp_mesh)
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
    """Global parameter counts: float8-converted linear and expert weights vs the rest."""
    names = set(report.converted) if report is not None else set()
    experts = set(report.experts_converted) if report is not None else set()
    converted = other = 0
    for fqn, p in model.named_parameters():
        fqn = fqn.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        if fqn.removesuffix(".weight") in names or fqn.rpartition(".")[0] in experts:
            converted += p.numel()
        else:
            other += p.numel()
    return {"float8_params": converted, "high_precision_params": other}
