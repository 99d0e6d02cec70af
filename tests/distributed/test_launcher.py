"""The distributed test harness itself: results come back, errors and hangs fail fast."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed.launcher import (
    DistributedError,
    DistributedTimeoutError,
    cpu_mesh,
    run_distributed,
)


def _all_reduce_and_mesh(rank: int, world_size: int, offset: float, *, scale: float) -> dict:
    t = torch.tensor([rank + offset]) * scale
    dist.all_reduce(t)
    mesh = cpu_mesh((world_size,), ("dp",))
    return {
        "rank": rank,
        "sum": t.item(),
        "mesh_shape": tuple(mesh.shape),
        "mesh_names": mesh.mesh_dim_names,
        "threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
    }


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from the test")
    # Rank 0 blocks on a collective rank 1 never joins: the launcher must not wait for it
    # until the timeout but fail soon after rank 1 reports.
    dist.barrier()
    return rank


def _only_rank_0_collects(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(60)


def test_all_reduce_returns_per_rank_values(tmp_path):
    results = run_distributed(_all_reduce_and_mesh, 2, tmp_path, 1.0, scale=2.0, timeout_s=60)
    assert [r["rank"] for r in results] == [0, 1]
    # (0 + 1) * 2 + (1 + 1) * 2 = 6 on every rank
    assert [r["sum"] for r in results] == [6.0, 6.0]
    assert all(r["mesh_shape"] == (2,) and r["mesh_names"] == ("dp",) for r in results)
    assert all(r["threads"] == 1 and r["backend"] == "gloo" for r in results)


def test_child_exception_is_reraised_with_rank(tmp_path):
    start = time.monotonic()
    with pytest.raises(DistributedError, match="rank 1") as info:
        run_distributed(_raise_on_rank_1, 2, tmp_path, timeout_s=60)
    err = info.value
    assert err.rank == 1
    assert "ValueError: boom from the test" in str(err)
    assert "_raise_on_rank_1" in err.traceback_text  # the child's own traceback
    assert isinstance(err.exception, ValueError)
    assert not isinstance(err, DistributedTimeoutError)
    assert time.monotonic() - start < 30


def test_deadlock_times_out_quickly(tmp_path):
    start = time.monotonic()
    with pytest.raises(DistributedTimeoutError, match="timeout_s=10") as info:
        run_distributed(_only_rank_0_collects, 2, tmp_path, timeout_s=10)
    elapsed = time.monotonic() - start
    assert elapsed < 25, f"the hung job took {elapsed:.1f} s to fail"
    message = str(info.value)
    assert "ranks still running: [0, 1]" in message
    # The stack dump shows where rank 0 is stuck; on a heavily loaded machine a rank may
    # still be importing torch after 10 s, and then there is no dump to show.
    assert "rank 0 Python stacks" in message
    assert "_only_rank_0_collects" in message or "(no stack dump)" in message
