"""The accelerate path, run under torchrun on CPU ranks (gloo): convert with fsdp_float8
before building the optimizer, then `Accelerator(mixed_precision="bf16", fsdp_plugin=FSDP2)`
and `prepare` (on CPU ranks the test sets the FSDP state accelerate sets on a GPU, see
`_fsdp_on_cpu_ranks`); and the same loop by hand (fully_shard with the same mixed-precision policy,
the same bf16 autocast around the forward). Writes each rank's losses of both loops.

torchrun --standalone --nproc_per_node 2 -m tests.integrations.accelerate_loop OUT.json
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_float8 import Float8LinearConfig, convert_to_float8_training

VOCAB, DIM, HIDDEN, SEQ, BATCH, STEPS = 256, 64, 256, 32, 4, 8
LR = 3e-3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build() -> nn.Module:
    torch.manual_seed(0)
    model = Tiny()
    config = Float8LinearConfig.from_recipe_name("tensorwise", enable_fsdp_float8_all_gather=True)
    # the head stays in high precision (the usual choice for an output projection)
    return convert_to_float8_training(
        model, config=config, module_filter_fn=lambda m, n: n != "head"
    )


def batches(rank: int):
    """Sequences of a fixed bigram rule (next = 5 * token + 1 mod VOCAB) from random starts:
    learnable, so the loss must fall within a few steps."""
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        tokens = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
        for i in range(SEQ):
            tokens[:, i + 1] = (5 * tokens[:, i] + 1) % VOCAB
        yield tokens[:, :-1], tokens[:, 1:]


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def _fsdp_on_cpu_ranks(accelerator, plugin) -> None:
    """Test-only: accelerate turns its FSDP plugin on for accelerator devices only (on CPU
    ranks it picks MULTI_CPU and ignores the plugin); set the state it sets on a GPU."""
    from accelerate.utils import DistributedType

    state = accelerator.state
    if state.distributed_type == DistributedType.MULTI_CPU:
        plugin.set_mixed_precision(accelerator.mixed_precision)
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2, state.distributed_type


def with_accelerate(rank: int) -> list[float]:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
    )
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", fsdp_plugin=plugin)
    _fsdp_on_cpu_ranks(accelerator, plugin)
    model = build()  # converted before the optimizer: it holds the float8 layers' weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for inputs, labels in batches(rank):
        loss = loss_of(model(inputs), labels)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def by_hand(rank: int) -> list[float]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    bf16 = torch.bfloat16
    policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16, output_dtype=bf16)
    model = build()
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for inputs, labels in batches(rank):
        with torch.autocast("cpu", dtype=bf16):
            logits = model(inputs)
        loss = loss_of(logits, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    rank = int(os.environ["RANK"])
    accelerated = with_accelerate(rank)  # accelerate initializes the process group
    reference = by_hand(rank)
    out = {"accelerate": accelerated, "by_hand": reference}
    with open(f"{sys.argv[1]}.rank{rank}", "w") as f:
        json.dump(out, f)
    # leave together: a rank that exits while gloo's threads still serve its peer can die in
    # C++ teardown ("terminate called without an active exception", seen once in CI's lane)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
