"""Process group and device mesh of a launched rank (``init_distributed`` -> ``Dist``), and
the object collectives with which its ranks agree (one rank: no collective).
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather_object(obj: Any) -> list[Any]:
    world = rank_world()[1]
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def broadcast_from_0(obj: Any) -> Any:
    if rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass(frozen=True)
class Dist:
    """Where this process sits. ``mesh`` is what ``fully_shard`` shards over; with ``--tp N``
    ``tp_mesh`` is the innermost dim of one mesh: the N ranks of a TP group are consecutive
    and read the same batch (the data is split over ``rank // tp``)."""

    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh
    tp_mesh: DeviceMesh | None
    tp: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mesh_shape(self) -> dict[str, int]:
        shape = dict(zip(self.mesh.mesh_dim_names, self.mesh.shape))
        return shape | ({"tp": self.tp} if self.tp > 1 else {})


def init_distributed(args: argparse.Namespace) -> Dist:
    """Init the process group (gloo on CPU, NCCL on CUDA) and an explicit device mesh.
    ``--pg-timeout-s`` bounds every collective: a rank waiting longer for its peers fails
    (gloo raises, NCCL's watchdog aborts) instead of hanging for torch's default 30 minutes."""
    device_type, tp = args.device, args.tp
    cuda = device_type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False; use --device cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    backend, timeout = ("nccl" if cuda else "gloo"), timedelta(seconds=args.pg_timeout_s)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if "RANK" not in os.environ:
        store, rank, world = dist.HashStore(), 0, 1
    # torchrun's workers share the agent's TCPStore with no per-attempt key prefix, so after
    # a restart gloo reads the previous attempt's peer addresses (pytorch/pytorch#135712):
    # each attempt gets its own prefix (docs/trainer.md)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and restarts > 0:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        agent = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world,
            is_master=False,
            timeout=timedelta(minutes=10),
        )
        store = dist.PrefixStore(f"f8train.train/attempt_{restarts}", agent)
    else:
        store, rank, world = None, -1, -1  # env:// rendezvous
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, device_id=device, timeout=timeout
    )
    if (problem := flags_problem(args)) is not None:  # before any collective they shape
        dist.destroy_process_group()
        raise SystemExit(problem)
    world = dist.get_world_size()
    mesh, tp_mesh = _meshes(device_type, world, args.hsdp_replicate, tp)
    return Dist(dist.get_rank(), world, device or torch.device("cpu"), mesh, tp_mesh, tp)


def _meshes(
    device_type: str, world: int, replicate: int, tp: int
) -> tuple[DeviceMesh, DeviceMesh | None]:
    """(data-parallel mesh, TP mesh or None): sub-meshes of one (replicate?, shard, tp?) mesh."""
    if tp < 1 or world % tp != 0:
        raise SystemExit(
            f"--tp {tp} with {world} ranks: expected a divisor of the world size "
            f"(data parallel x tensor parallel = {world})"
        )
    dp = world // tp
    if replicate < 1 or dp % replicate != 0:
        raise SystemExit(
            f"--hsdp-replicate {replicate} with {dp} data-parallel ranks ({world} / --tp {tp}): "
            f"expected a divisor of it (replicate x shard = {dp})"
        )
    shape, names = [dp], ["shard"]
    if replicate > 1:
        shape, names = [replicate, dp // replicate], ["replicate", "shard"]
    if tp == 1:
        return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names)), None
    full = init_device_mesh(device_type, (*shape, tp), mesh_dim_names=(*names, "tp"))
    return full[tuple(names)], full["tp"]


def start_failure_message(err: BaseException, timeout_s: float) -> str | None:
    """What to tell the user when the process group did not form: a rank waited
    ``--pg-timeout-s`` for peers that never joined (None for any other error)."""
    if not isinstance(err, dist.DistStoreError) or "timeout" not in str(err).lower():
        return None
    first = str(err).strip().splitlines()[0]
    return (
        f"rank {os.environ.get('RANK', '?')}: the process group did not form within "
        f"--pg-timeout-s {timeout_s:g} s ({first}): another rank never joined. It stopped at "
        "start-up (its node's log, or torchrun's failure summary there, says why: e.g. a "
        "flag it refused), or its node was not started. Start every node with the same "
        "command."
    )


def collective_failure_message(err: BaseException, rank: int, timeout_s: float) -> str | None:
    """What to tell the user when ``err`` is a collective that timed out, or one whose peer
    went away (the first rank to time out exits, and its peers then see a closed
    connection); None for any other error."""
    text = str(err).strip()
    if not isinstance(err, RuntimeError) or not text:
        return None
    first = text.splitlines()[0]
    if "timed out" in text.lower():
        return (
            f"rank {rank}: a collective did not complete within --pg-timeout-s {timeout_s:g} s "
            f"({first}). Another rank stopped, crashed or is stuck: its log says which and "
            "why. If the step or checkpoint save is merely slow, raise --pg-timeout-s."
        )
    if any(word in text for word in ("Connection closed by peer", "Connection reset by peer")):
        return (
            f"rank {rank}: a collective failed because another rank closed its connection "
            f"({first}). That rank stopped or crashed first: its log says why."
        )
    return None


# flags that name a path on this node: they may differ where nodes mount a shared folder at
# other paths (--out is checked by what the ranks see in it, --data by its tokens)
PER_NODE_FLAGS = frozenset({"out", "data", "cache_dir"})


def ranks_text(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0-3``, ``ranks 0, 2``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def differences(values: list[dict[str, Any]], show=repr) -> list[str]:
    """One line per key whose value differs across ranks (``values[r]``: rank r's):
    ``key: ranks 0-3 V, ranks 4-7 W``."""
    lines = []
    for key in sorted(set().union(*values)):
        holders: dict[str, list[int]] = {}
        for rank, mine in enumerate(values):
            holders.setdefault(show(mine.get(key)), []).append(rank)
        if len(holders) > 1:
            lines.append(f"{key}: " + ", ".join(f"{ranks_text(r)} {v}" for v, r in holders.items()))
    return lines


def flags_problem(args: argparse.Namespace) -> str | None:
    """Every rank must run with the same flags (the steps, the batch, the model, the
    recipe...), or their collectives differ in number and size and the job aborts or
    hangs later, naming nothing: the flags of every rank are gathered and compared
    (collective); the flags that name a node's own paths are left out."""
    mine = {f"--{k.replace('_', '-')}": v for k, v in vars(args).items() if k not in PER_NODE_FLAGS}
    lines = differences(all_gather_object(mine))
    if not lines:
        return None
    listed = "\n".join(f"  {line}" for line in lines)
    return (
        f"rank {dist.get_rank()}: the ranks were started with different flags:\n{listed}\n"
        "every rank must run the same training flags: start every node with the same "
        "command (only the launcher's node rank may differ)"
    )


SHARED_WAIT_S = 10.0  # how long a rank looks for rank 0's file (a network file system's lag)


def out_shared_problem(out: Path) -> str | None:
    """Every rank writes its checkpoint shards under ``--out``, which must therefore be one
    folder that all of them see: rank 0 writes a file with a random name there, the others
    look for it (collective; rank 0 removes it)."""
    rank, world = rank_world()
    if world == 1:
        return None
    name = broadcast_from_0(f".shared_check_{secrets.token_hex(8)}" if rank == 0 else None)
    path = Path(out) / name
    if rank == 0:
        path.write_text(name)
    dist.barrier()  # written before anyone looks
    deadline = time.monotonic() + SHARED_WAIT_S
    while not (seen := _holds(path, name)) and time.monotonic() < deadline:
        time.sleep(0.5)
    found = all_gather_object((seen, socket.gethostname()))
    if rank == 0:
        path.unlink(missing_ok=True)
    blind = [r for r, (ok, _) in enumerate(found) if not ok]
    if not blind:
        return None
    hosts = sorted({found[r][1] for r in blind})
    return (
        f"--out {out} is not one folder shared by all ranks: {ranks_text(blind)} (on "
        f"{', '.join(hosts)}) do not see the file {name} that rank 0 (on {found[0][1]}) "
        f"wrote in it within {SHARED_WAIT_S:g} s. Every rank writes its checkpoint shards "
        "there and rank 0 the manifest, so --out must be a folder on a file system that "
        "every node mounts (NFS, Lustre, ...): pass such a folder as --out on every node"
    )


def _holds(path: Path, text: str) -> bool:
    try:
        return path.read_text() == text
    except OSError:
        return False
