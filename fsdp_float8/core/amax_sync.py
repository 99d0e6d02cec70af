"""Cross-rank amax reduction: the only caller of all_reduce(MAX) in the package.

A batch of amaxes always travels as one float32 vector in one collective. The group is
always explicit: a ProcessGroup, a DeviceMesh (reduced over all of its ranks), or None,
which means a single process and no collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

Group = dist.ProcessGroup | DeviceMesh | None


def group_of(group: Group) -> dist.ProcessGroup | None:
    """The process group spanning every rank of `group` (None: no collective needed)."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    if group.size() == 1:
        return None
    if group.ndim == 1:
        return group.get_group()
    if group.size() == dist.get_world_size():
        return dist.group.WORLD
    return group._flatten().get_group()


def all_reduce_amax_(amaxes: torch.Tensor, group: Group) -> torch.Tensor:
    """In-place MAX over the ranks of `group`, one collective for the whole vector."""
    if amaxes.dtype != torch.float32:
        raise TypeError(f"amaxes must be float32, got {amaxes.dtype}")
    pg = group_of(group)
    if pg is not None and dist.get_world_size(pg) > 1:
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=pg)
    return amaxes


def reduce_amaxes(amaxes: list[torch.Tensor], group: Group) -> torch.Tensor:
    """Stack 0-d amaxes, reduce them in one collective, return the reduced vector."""
    if not amaxes:
        return torch.empty(0)
    stacked = torch.stack([a.reshape(()).to(torch.float32) for a in amaxes])
    return all_reduce_amax_(stacked, group)


def shard_group(param: torch.Tensor, dims: tuple[int, ...] | None, default: Group) -> Group:
    """Where an amax over `dims` of a parameter's local shard must be reduced: the mesh dims
    of its DTensor whose placement shards one of `dims` (None: all dims, a tensorwise amax).
    `default` when `param` is not a DTensor. None when no mesh dim shards them (the amax is
    local, e.g. per-row scales of a weight sharded by rows only)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return default
    mesh = param.device_mesh
    hit = [
        i
        for i, p in enumerate(param.placements)
        if isinstance(p, Shard)
        and (dims is None or p.dim % param.ndim in [d % param.ndim for d in dims])
    ]
    if not hit:
        return None
    if len(hit) == 1:
        return mesh.get_group(hit[0])
    names = mesh.mesh_dim_names
    if len(hit) == mesh.ndim or names is None:
        return mesh  # the whole mesh: its other dims replicate the values, MAX is the same
    return mesh[tuple(names[i] for i in hit)]
