"""Shared pieces of the FSDP2 + float8 distributed tests: models, batches, configs, and one
training loop run twice (FSDP2, and a replicated reference with hand-averaged gradients).

Everything here runs inside `run_distributed` children, so it is module level and picklable.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdp_float8 import (
    CastConfig,
    Float8LinearConfig,
    convert_to_float8_training,
    float8_step,
    precompute_float8_dynamic_scale_for_fsdp,
    sync_float8_amax_and_scale_history,
)
from fsdp_float8.tools.comm_stats import CollectiveCounter
from tests.models import Transformer, model_args


@dataclass(frozen=True)
class Case:
    scaling: str = "dynamic"  # dynamic | delayed | static | mixed (delayed activations)
    recipe: str = "tensorwise"
    fp8_all_gather: bool = True
    # True: the training loops call no float8 function, the converted root's hook refreshes
    # precomputed weight scales and delayed state; False (dynamic only): that hook removed,
    # each float8-gathered weight all-reduces its own amax at every all-gather
    precompute: bool = True
    mp_bf16: bool = False
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    compile: bool = False  # per-block torch.compile (aot_eager), as training scripts do
    model: str = "llama"  # llama | mlp (blocks with no norm: float8 weights alone)
    n_layers: int = 2
    dim: int = 64
    narrow_head: bool = False  # mlp: end with Linear(dim, 2): fewer rows than ranks
    steps: int = 10

    @property
    def name(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.__dict__.items())


def float8_config(case: Case, *, all_gather: bool) -> Float8LinearConfig:
    if case.scaling == "dynamic":
        base = Float8LinearConfig.from_recipe_name(case.recipe)
    elif case.scaling == "delayed":
        d = CastConfig(scaling_type="delayed")
        base = Float8LinearConfig(
            cast_config_input=d, cast_config_weight=d, cast_config_grad_output=d
        )
    elif case.scaling == "mixed":  # delayed input and grad_output, dynamic weight
        d = CastConfig(scaling_type="delayed")
        base = Float8LinearConfig(cast_config_input=d, cast_config_grad_output=d)
    elif case.scaling == "static":
        base = Float8LinearConfig(
            cast_config_input=CastConfig(scaling_type="static", static_scale=64.0),
            cast_config_weight=CastConfig(scaling_type="static", static_scale=2048.0),
            cast_config_grad_output=CastConfig(scaling_type="static", static_scale=2.0**20),
        )
    else:
        raise ValueError(case.scaling)
    return replace(base, enable_fsdp_float8_all_gather=all_gather, pad_inner_dim=case.narrow_head)


def build_model(case: Case, seed: int = 0) -> nn.Module:
    if case.model == "llama":
        args = model_args(
            "tiny",
            dim=case.dim,
            n_layers=case.n_layers,
            n_heads=4,
            n_kv_heads=2,
            multiple_of=16,
            max_seq_len=32,
        )
        model = Transformer(args)
        model.init_weights(seed)
        return model
    torch.manual_seed(seed)
    return LinearStack(case.dim, case.n_layers, case.narrow_head)


class LinearStack(nn.Module):
    """Blocks that are a bare nn.Linear: under per-block fully_shard a group holds only a
    float8 weight, so FSDP2 packs float8 all-gather inputs alone."""

    def __init__(self, dim: int, n_layers: int, narrow_head: bool = False):
        super().__init__()
        pairs = [(dim, 2 * dim), (2 * dim, dim)] * n_layers + ([(dim, 2)] if narrow_head else [])
        self.blocks = nn.ModuleList(nn.Linear(i, o, bias=False) for i, o in pairs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            x = nn.functional.gelu(x) if i % 2 == 0 else x
        return x


def float8_filter(module: nn.Module, fqn: str) -> bool:
    return fqn != "output"


def batch(case: Case, step: int, rank: int, world_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step * 97 + rank)
    if case.model == "llama":
        return torch.randint(0, 256, (2, 17), generator=g)
    return torch.randn(8, case.dim, generator=g)


def loss_of(model: nn.Module, case: Case, x: torch.Tensor) -> torch.Tensor:
    if case.model == "llama":
        logits = model(x[:, :-1])
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
    return model(x).float().pow(2).mean()


def shard(model: nn.Module, case: Case, mesh) -> nn.Module:
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if case.mp_bf16 else None,
        reduce_dtype=torch.float32 if case.mp_bf16 else None,
    )
    kw = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=case.reshard_after_forward)
    for i, block in enumerate(model.blocks):
        if case.activation_checkpointing:
            block = checkpoint_wrapper(block)
            model.blocks[i] = block
        if case.compile:
            block.compile(backend="aot_eager")
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def fsdp_all_gathers(counter) -> int:
    """All-gathers issued by FSDP2 (the float8 step issues none: its rank check goes through
    the store)."""
    return sum(1 for r in counter.records if str(r.kind) == "all_gather")


def convert(model: nn.Module, case: Case, *, all_gather: bool) -> nn.Module:
    convert_to_float8_training(
        model, config=float8_config(case, all_gather=all_gather), module_filter_fn=float8_filter
    )
    if not case.precompute:
        assert case.scaling == "dynamic", "without the refresh hook delayed never syncs"
        float8_step(model).disable()
    return model


def shard_with_optimizer(model: nn.Module, case: Case, mesh) -> torch.optim.Optimizer:
    shard(model, case, mesh)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)


def explicit_refresh(model: nn.Module, case: Case) -> None:
    """What a training loop calls with the float8 step off (torchao's loop), before the
    first forward and after each optimizer step: the pass(es) its float8 layers need."""
    if case.scaling in ("dynamic", "mixed"):
        precompute_float8_dynamic_scale_for_fsdp(model)
    if case.scaling in ("delayed", "mixed"):
        sync_float8_amax_and_scale_history(model)


def scale_collectives(counter: CollectiveCounter) -> int:
    """The scale collectives among those counted: all-reduces with MAX (a refresh vector,
    or a weight's own amax; the ranks' configs are compared through the store)."""
    return sum(1 for r in counter.records if str(r.kind) == "all_reduce" and r.reduce_op == "max")


def train_and_count(
    model: nn.Module,
    opt,
    case: Case,
    rank: int,
    world_size: int,
    *,
    count,
    loss_fn=None,
    after_step=None,
) -> tuple[list[float], list[int]]:
    """`case.steps` training steps (forward, backward, optimizer step, then `after_step()`),
    each under a CollectiveCounter: the losses, and `count(counter)` of each step."""
    losses, counts = [], []
    for step in range(case.steps):
        with CollectiveCounter() as counter:
            loss = (loss_fn or loss_of)(model, case, batch(case, step, rank, world_size))
            loss.backward()
            opt.step()
            opt.zero_grad()
            if after_step is not None:
                after_step()
        losses.append(loss.item())
        counts.append(count(counter))
    return losses, counts


def train_fsdp(case: Case, mesh, rank: int, world_size: int) -> list[float]:
    model = convert(build_model(case), case, all_gather=case.fp8_all_gather)
    opt = shard_with_optimizer(model, case, mesh)
    losses = []
    for step in range(case.steps):
        loss = loss_of(model, case, batch(case, step, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_reference(
    case: Case, rank: int, world_size: int, *, order: str = "all_reduce"
) -> list[float]:
    """Replicated float8 model on each rank, same init and local batch, grads averaged by hand.

    `order` is how the per-rank gradients are summed: "all_reduce" (gloo's own order), or
    all-gathered and added in rank order ("forward": 0..N-1) or reversed ("reverse"). With
    2 ranks all three are the same (a + b == b + a); with more, two orders give two equally
    valid references whose spread measures how far reduction order alone moves the losses.
    """
    master = build_model(case)
    # rowwise weights under float8 all-gather re-cast grad_input's weight from the row-cast
    # weight, sharded or not: the reference keeps that config (its weights stay unsharded)
    rowwise_ag = case.fp8_all_gather and case.recipe != "tensorwise"
    convert(master, case, all_gather=rowwise_ag)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2, foreach=True)
    work = copy.deepcopy(master).to(torch.bfloat16) if case.mp_bf16 else master
    # replicated, not sharded: the hook cannot know the delayed layers' group; this first
    # sync names it (remembered by the automatic refreshes that follow) and seeds the weight
    # scales (a model without delayed layers takes no group)
    delayed = case.scaling in ("delayed", "mixed")
    sync_float8_amax_and_scale_history(work, group=dist.group.WORLD if delayed else None)
    losses = []
    for step in range(case.steps):
        if case.mp_bf16:
            with torch.no_grad():
                for w, m in zip(work.parameters(), master.parameters(), strict=True):
                    w.copy_(m)
        x = batch(case, step, rank, world_size)
        if case.mp_bf16 and x.is_floating_point():  # as FSDP2's cast_forward_inputs does
            x = x.to(torch.bfloat16)
        loss = loss_of(work, case, x)
        loss.backward()
        for w, m in zip(work.parameters(), master.parameters(), strict=True):
            m.grad = _sum_over_ranks(w.grad.float(), order, world_size) / world_size
        if case.mp_bf16:
            work.zero_grad()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _sum_over_ranks(grad: torch.Tensor, order: str, world_size: int) -> torch.Tensor:
    if order == "all_reduce":
        dist.all_reduce(grad)
        return grad
    parts = [torch.empty_like(grad) for _ in range(world_size)]
    dist.all_gather(parts, grad)
    if order == "pairs":  # HSDP (replicas, 2): each pair in its reduce-scatter, then across
        parts = [parts[i] + parts[i + 1] for i in range(0, world_size, 2)]
    elif order == "reverse":
        parts.reverse()
    elif order != "forward":
        raise ValueError(f"order={order!r}: expected 'all_reduce', 'forward', 'reverse' or 'pairs'")
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return total


def global_batch(case: Case, step: int, rank: int, world_size: int, rows: int = 4):
    """Rank `rank`'s slice of a global batch that does not depend on the world size."""
    g = torch.Generator().manual_seed(5000 + step)
    full = torch.randint(0, 256, (rows, 17), generator=g)
    per_rank = rows // world_size
    return full[rank * per_rank : (rank + 1) * per_rank]
