"""Two hazards of the float8 all-gather hook, on 2 gloo ranks (one spawn for both):

- the refresh the hook may start (a weight with no fresh scale: the first forward of a
  converted container that sits inside the FSDP2 root) runs on the caller's stream. FSDP2
  calls `fsdp_pre_all_gather` inside `torch.<device>.stream(all-gather copy-in stream)`
  (on CPU too: `torch.cpu.stream` tracks a current stream), and a refresh made there writes
  scales and delayed buffers that the caller's stream reads without waiting. Checked by
  recording the current stream in every refresh of a short training run;
- a rowwise weight's row scales are reduced over the mesh dims that split its rows, read
  from the dim the scale spans (the last: the output GEMM's contraction dim), so a 3-D
  expert weight whose rows are split over the ranks (expert tensor parallelism shards the
  `in` dim, `Shard(2)`) casts as the unsharded weight does, bit for bit.
"""

from __future__ import annotations

import traceback

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from fsdp_float8 import (
    CastConfig,
    DynamicFloat8Weight,
    Float8LinearConfig,
    ScalingType,
    convert_to_float8_training,
)
from fsdp_float8.experts.modules import Float8GroupedExperts
from fsdp_float8.fsdp import refresh as refresh_module
from tests.distributed.launcher import cpu_mesh, run_distributed
from tests.models import GroupedExperts


def _refresh_streams(mesh, scaling: str) -> list[tuple[bool, bool]]:
    """(refresh ran on the caller's stream, refresh called from inside the all-gather hook)
    for every refresh of 2 training steps."""
    caller = torch.cpu.current_stream()
    seen: list[tuple[bool, bool]] = []
    original = refresh_module.refresh_units

    def recording(*args, **kwargs):
        in_hook = any(f.name == "fsdp_pre_all_gather" for f in traceback.extract_stack())
        seen.append((torch.cpu.current_stream() is caller, in_hook))
        return original(*args, **kwargs)

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(32, 32, bias=False), nn.ReLU(), nn.Linear(32, 32, bias=False))
    if scaling == "delayed":
        d = CastConfig(scaling_type=ScalingType.DELAYED)
        config = Float8LinearConfig(
            cast_config_input=d,
            cast_config_weight=d,
            cast_config_grad_output=d,
            enable_fsdp_float8_all_gather=True,
        )
    else:
        config = Float8LinearConfig.from_recipe_name(
            "tensorwise", enable_fsdp_float8_all_gather=True
        )
    convert_to_float8_training(inner, config=config, module_filter_fn=lambda m, n: True)
    model = nn.Sequential(inner)  # the converted container sits inside the FSDP2 root
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    refresh_module.refresh_units = recording
    try:
        for _ in range(2):
            model(torch.randn(8, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        refresh_module.refresh_units = original
    return seen


def _row_split_expert_scales(rank: int, mesh) -> bool:
    """Whether the row scales of a (E, out, in) expert weight split `Shard(2)` over the
    ranks equal the unsharded weight's."""
    config = Float8LinearConfig.from_recipe_name("rowwise", enable_fsdp_float8_all_gather=True)
    torch.manual_seed(0)
    hp = GroupedExperts(64, 32, 2)
    for p in hp.parameters():
        nn.init.normal_(p)
    experts = Float8GroupedExperts.from_experts(hp, config)
    full = experts.w1.data
    assert isinstance(full, DynamicFloat8Weight)
    reference = _gathered_row_scales(full, experts)
    local = DynamicFloat8Weight(full._tensor.chunk(2, dim=2)[rank].contiguous(), config)
    local.param_name = "w1"
    sharded = DTensor.from_local(local, mesh, [Shard(2)], run_check=False)
    experts.w1 = nn.Parameter(sharded)
    return torch.equal(_gathered_row_scales(local, experts), reference)


class _OneShard:
    def size(self) -> int:
        return 1


def _gathered_row_scales(w: DynamicFloat8Weight, module: nn.Module) -> torch.Tensor:
    inputs, meta = w.fsdp_pre_all_gather(_OneShard(), w.shape, w.stride(), module, None)
    return meta.unpack(inputs)[1]


def _grid(rank: int, world_size: int):
    mesh = cpu_mesh(world_size)
    streams = {s: _refresh_streams(mesh, s) for s in ("dynamic", "delayed")}
    return streams, _row_split_expert_scales(rank, mesh)


def test_refresh_on_the_callers_stream_and_row_scales_of_split_expert_rows(tmp_path):
    problems = []
    for rank, (streams, same_row_scales) in enumerate(
        run_distributed(_grid, 2, tmp_path, timeout_s=300)
    ):
        for scaling, seen in streams.items():
            # the path under test ran: a refresh started by the all-gather hook
            if not any(in_hook for _, in_hook in seen):
                problems.append(f"rank {rank} {scaling}: no refresh from the hook {seen}")
            if not all(on_caller for on_caller, _ in seen):
                problems.append(f"rank {rank} {scaling}: a refresh off the caller's stream {seen}")
        if not same_row_scales:
            problems.append(f"rank {rank}: split expert rows cast unlike the unsharded weight")
    assert problems == []
