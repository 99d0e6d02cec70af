"""FSDP2 + float8 on torch's multi-threaded test process group: two ranks as two threads of
one process (the `threaded` backend of `torch.testing._internal.distributed.
multi_threaded_pg`, which torch's and torchao's `FSDPTestMultiThread` tests use).

Run as `python -m tests.distributed.threaded_pg_case`: each thread-rank converts, shards and
trains the same LinearStack on the same batches for 3 steps (optimizer step, then torchao's
explicit precompute), and one process-local model trains alike as the reference; then a
deferred check queued by rank 1 must be read by rank 1, not rank 0. Prints one JSON line:
the losses of each rank and of the reference, and what each rank's read of the deferred
checks did. `test_threaded_pg.py` runs it in a
subprocess under a timeout, so a rank that waits forever fails the test instead of hanging
pytest.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading

import torch
import torch.distributed as dist

from fsdp_float8 import (
    Float8LinearConfig,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
)
from fsdp_float8.fsdp import refresh
from tests.distributed.float8_cases import Case, batch, build_model, loss_of, shard

CASE = Case(model="mlp", n_layers=1, dim=32, steps=3)
CONFIG = Float8LinearConfig.tensorwise(enable_fsdp_float8_all_gather=True)
WORLD = 2
# build_model seeds torch's process-wide generator; thread-ranks that build at once draw
# from it in turn, and each rank would keep shards of a different mix of weights
_BUILD = threading.Lock()


def train(model: torch.nn.Module) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(CASE.steps):
        loss = loss_of(model, CASE, batch(CASE, step, 0, 1))  # the same batch on every rank
        loss.backward()
        opt.step()
        opt.zero_grad()
        precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.item())
    return losses


def rank_main(rank: int, store: dist.Store, out: dict) -> None:
    try:
        dist.init_process_group("threaded", rank=rank, world_size=WORLD, store=store)
        with _BUILD:
            model = convert_to_float8_training(build_model(CASE), config=CONFIG)
        mesh = dist.device_mesh.init_device_mesh("cpu", (WORLD,))
        out[rank] = train(shard(model, CASE, mesh))
        out[f"pending {rank}"] = deferred_check_stays_with_its_rank(rank)
    except BaseException as e:  # reported in the JSON line
        out[rank] = f"{type(e).__name__}: {e}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _Landed:
    """A device event that has completed (what `read_pending_checks` polls)."""

    def query(self) -> bool:
        return True


def deferred_check_stays_with_its_rank(rank: int) -> str:
    """Rank 1 queues a deferred "ran on some ranks only" check, as an accelerator refresh
    does; rank 0 reads its own checks first, then rank 1: only rank 1 may raise."""
    if rank == 1:
        reader = functools.partial(refresh._raise_if_mixed, ["blocks.0"])
        refresh._pending().append((_Landed(), torch.tensor([True]), reader))
    said = "nothing"
    for turn in range(WORLD):
        dist.barrier()
        if turn == rank:
            try:
                refresh.read_pending_checks()
            except ValueError:
                said = "raised"
    return said


def main() -> None:
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg

    out: dict = {"reference": train(convert_to_float8_training(build_model(CASE), config=CONFIG))}
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    store = dist.HashStore()
    threads = [threading.Thread(target=rank_main, args=(r, store, out)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)  # threaded process groups leave state that can block interpreter exit


if __name__ == "__main__":
    main()
