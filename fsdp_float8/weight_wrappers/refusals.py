"""The sharding layouts a float8 all-gather refuses, checked by `fsdp_pre_all_gather` before
it casts anything.

Each check reads only what every rank sees alike (the shard's shape and device against its
sharded parameter's, the padded size FSDP2 hands the hook), so either every rank raises the
same error or none does: no rank is left waiting in the all-gather. The error names the
layout, why the format cannot serve it and what to change.
"""

from __future__ import annotations

from typing import Protocol

import torch

from fsdp_float8.core.families import one_scale, recipes_where


class GatheredShard(Protocol):
    """What the checks read of a weight wrapper's local shard."""

    param_name: str  # the module attribute that holds the sharded parameter

    @property
    def shape(self) -> torch.Size: ...

    @property
    def device(self) -> torch.device: ...


def refuse_cpu_offload(moved: GatheredShard, module) -> None:
    """Under FSDP2's CPUOffloadPolicy the sharded weight stays on the CPU and the pre-hook
    runs on a copy moved to the GPU: a scale made from the CPU shard (precompute, delayed
    state) would sit on the wrong device. Every rank sees the same, so every rank raises."""
    sharded = getattr(getattr(module, moved.param_name, None), "_local_tensor", None)
    if sharded is not None and sharded.device != moved.device:
        raise ValueError(
            f"float8 all-gather of a weight offloaded to {sharded.device} and gathered on "
            f"{moved.device} (FSDP2 offload_policy=CPUOffloadPolicy()) is not supported; "
            "drop the offload policy or set enable_fsdp_float8_all_gather=False"
        )


def refuse_shards_across_rows(shard: GatheredShard, outer_size, module) -> None:
    """FSDP2 with `shard_placement_fn` returning Shard(d), d > 0, cuts every row: a format
    whose scales are laid along the rows cannot be packed per shard. The shard's shape says
    so on every rank (a dim-0 shard keeps the other dims whole), so every rank raises."""
    cut = [d for d in range(1, len(outer_size)) if shard.shape[d] != outer_size[d]]
    if cut:
        raise ValueError(
            f"float8 all-gather of the {tuple(outer_size)} {shard.param_name} of "
            f"{type(module).__name__} sharded as Shard({cut[0]}) (fully_shard("
            f"shard_placement_fn=...)) is not supported by its format "
            f"({type(shard).__name__}): its scales follow the rows, so each rank must hold "
            "whole rows (Shard(0), FSDP2's default). Return Shard(0) for this weight from "
            f"shard_placement_fn (or drop it), use the {recipes_where(one_scale)} recipe, or set "
            "enable_fsdp_float8_all_gather=False (gathered in high precision, cast after)"
        )
