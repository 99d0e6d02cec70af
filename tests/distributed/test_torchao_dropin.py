"""torchao users switch by changing the import: a torchtitan-style float8 converter sequence
with `fsdp_float8` imports, under FSDP2 on 2 gloo ranks, trains with the same losses as a
replicated float8 reference with hand-averaged gradients.

The sequence: a config from torchao's tensorwise flags (float8 all-gather,
`force_recompute_fp8_weight_in_bwd`) or from `Float8LinearRecipeName.ROWWISE`, the module
filter from `_auto_filter_for_recipe` (or torchao's README filter), `convert_to_float8_training`,
`fully_shard`, and `precompute_float8_dynamic_scale_for_fsdp` after each `optimizer.step()`.
With fp32 parameters on 2 ranks a sum of two gradients has one order, so the losses are
equal, not close (as in test_fsdp_parity.py).
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

# the imports a torchao user changes: `from torchao.float8 import ...`
from fsdp_float8 import (
    Float8LinearConfig,
    Float8LinearRecipeName,
    _auto_filter_for_recipe,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
)
from tests.distributed.launcher import cpu_mesh, run_distributed

STEPS = 6


class Net(nn.Module):
    """Blocks that torchao's tensorwise auto filter keeps (out_features > 1024), one it
    skips as too small, and an `output` head it skips by name."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(64, 1040), nn.Linear(1040, 64)])
        self.output = nn.Linear(64, 1040)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.output(x)


def readme_filter(mod: nn.Module, fqn: str) -> bool:
    return fqn != "output" and mod.in_features % 16 == 0 and mod.out_features % 16 == 0


def converter(recipe: str | None):
    """torchtitan's float8 converter: (config, module filter, precompute after step)."""
    if recipe is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torchtitan passes it
            config = Float8LinearConfig(
                enable_fsdp_float8_all_gather=True, force_recompute_fp8_weight_in_bwd=True
            )
        return config, _auto_filter_for_recipe("tensorwise", filter_fqns=["output"]), True
    config = Float8LinearConfig.from_recipe_name(Float8LinearRecipeName(recipe))
    return config, readme_filter, False


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(recipe: str | None, rank: int, world_size: int, mesh) -> tuple[list, list, list]:
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    config, filter_fn, precompute = converter(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=filter_fn)
    # the reference: the same float8 layers, replicated, without the float8 all-gather
    ref_config = Float8LinearConfig.from_recipe_name(recipe or "tensorwise")
    convert_to_float8_training(ref, config=ref_config, module_filter_fn=filter_fn)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses, ref_losses = [], []
    for step in range(STEPS):
        x = _batch(step, rank)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if precompute:
            precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.item())
        ref_loss = ref(x).pow(2).mean()
        ref_loss.backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    return losses, ref_losses, model.float8_conversion_report.converted


def _cases(rank: int, world_size: int) -> dict:
    mesh = cpu_mesh(world_size)
    return {str(r): _train(r, rank, world_size, mesh) for r in (None, "rowwise")}


def test_torchtitan_sequence_under_fsdp2_matches_reference(tmp_path):
    results = run_distributed(_cases, 2, tmp_path, timeout_s=300)
    for rank, per_case in enumerate(results):
        for name, (losses, ref_losses, converted) in per_case.items():
            want = ["blocks.0"] if name == "None" else ["blocks.0", "blocks.1"]
            assert converted == want, (name, converted)
            assert losses == ref_losses, f"rank {rank} {name}: {losses} != {ref_losses}"
            assert losses[-1] < losses[0], f"{name} did not train: {losses}"
