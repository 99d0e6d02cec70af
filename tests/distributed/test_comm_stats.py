"""CollectiveCounter sees FSDP2's collectives, plain c10d calls and functional collectives.

All cases run inside one 2-rank spawn (module-scoped fixture); each test checks one case.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdp_float8.core._compat import all_gather_single
from fsdp_float8.tools.comm_stats import CollectiveCounter, CollectiveKind
from tests.distributed.launcher import cpu_mesh, run_distributed

WORLD_SIZE = 2
DIMS = (8, 16, 4)  # Linear(8, 16) -> ReLU -> Linear(16, 4); out dims divide WORLD_SIZE
STEPS = 2


def _model(mesh, **fsdp_kwargs) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIMS[0], DIMS[1]), nn.ReLU(), nn.Linear(DIMS[1], DIMS[2]))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model


def _fsdp_steps(mesh, **fsdp_kwargs) -> list[dict]:
    """Per training step: the counter's summary and its records as plain dicts."""
    model = _model(mesh, **fsdp_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, DIMS[0])
    steps = []
    counter = CollectiveCounter()
    for _ in range(STEPS):
        counter.reset()
        with counter:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        steps.append({"summary": counter.summary(), "records": counter.as_dicts()})
    return steps


def _plain_and_functional(mesh) -> dict:
    out = {}
    with CollectiveCounter() as counter:
        dist.all_reduce(torch.ones(3), op=dist.ReduceOp.MAX)
    out["all_reduce_max"] = counter.as_dicts()

    with CollectiveCounter() as counter:
        a = funcol.all_reduce(torch.ones(5), "sum", mesh)
        g = funcol.all_gather_tensor(torch.ones(3, 2), 0, mesh)
        s = funcol.reduce_scatter_tensor(torch.ones(4, 2), "avg", 0, mesh)
        torch.cat([a.flatten(), g.flatten(), s.flatten()])  # waits on all three
    out["functional"] = counter.as_dicts()

    with CollectiveCounter() as counter:
        # FSDP2 packs float8 all-gather inputs as uint8 (gloo rejects float8 dtypes)
        shard = torch.arange(6, dtype=torch.uint8)
        gathered = torch.empty(6 * WORLD_SIZE, dtype=torch.uint8)
        all_gather_single(gathered, shard)
        dist.broadcast(torch.zeros(2, dtype=torch.float64), src=0)
        dist.barrier()
    out["uint8_broadcast_barrier"] = counter.as_dicts()

    dist.all_reduce(torch.ones(1))  # outside any counter: must not be recorded
    out["outside_count"] = counter.count()
    return out


def _all_cases(rank: int, world_size: int) -> dict:
    mesh = cpu_mesh((world_size,), ("dp",))
    return {
        "default": _fsdp_steps(mesh),
        "no_reshard": _fsdp_steps(mesh, reshard_after_forward=False),
        "bf16_params": _fsdp_steps(
            mesh,
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        ),
        "plain": _plain_and_functional(mesh),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_distributed(_all_cases, WORLD_SIZE, tmp_path_factory.mktemp("comm"), timeout_s=60)


def _layer_numels() -> list[int]:
    """Parameter elements of each FSDP group (weight + bias of each Linear)."""
    return [DIMS[i] * DIMS[i + 1] + DIMS[i + 1] for i in range(len(DIMS) - 1)]


def _kinds(records: list[dict]) -> list[str]:
    return [r["kind"] for r in records]


def test_ranks_agree(results):
    assert results[0] == results[1]


@pytest.mark.parametrize("case", ["default", "no_reshard"])
def test_fsdp2_all_gathers_and_reduce_scatters_per_step(results, case):
    numels = _layer_numels()
    fwd = list(numels)  # forward gathers layer 0 then layer 1
    # reshard_after_forward=True frees the unsharded params after forward, so backward
    # gathers them again, last layer first; with False the forward gathers are kept.
    bwd = list(reversed(numels)) if case == "default" else []
    for step in results[0][case]:
        ag = [r for r in step["records"] if r["kind"] == "all_gather"]
        rs = [r for r in step["records"] if r["kind"] == "reduce_scatter"]
        assert set(_kinds(step["records"])) == {"all_gather", "reduce_scatter"}
        # all-gather input: this rank's fp32 shard = param bytes / world size
        assert [r["bytes"] for r in ag] == [n * 4 // WORLD_SIZE for n in fwd + bwd]
        # reduce-scatter input: the full unsharded fp32 gradient, last layer first
        assert [r["bytes"] for r in rs] == [n * 4 for n in reversed(numels)]
        assert all(r["dtype"] == "torch.float32" for r in ag + rs)
        assert all(r["op"] == "c10d._allgather_base_.default" for r in ag)
        assert all(r["op"] == "c10d._reduce_scatter_base_.default" for r in rs)
        assert all(r["group_size"] == WORLD_SIZE for r in ag + rs)
        assert all(r["reduce_op"] == "avg" for r in rs)  # seen on gloo, torch 2.13
        summary = step["summary"]
        assert summary["all_gather"]["count"] == len(fwd + bwd)
        assert summary["reduce_scatter"]["count"] == len(numels)


def test_fsdp2_mixed_precision_gathers_bf16(results):
    numels = _layer_numels()
    for step in results[0]["bf16_params"]:
        ag = [r for r in step["records"] if r["kind"] == "all_gather"]
        rs = [r for r in step["records"] if r["kind"] == "reduce_scatter"]
        assert all(r["dtype"] == "torch.bfloat16" for r in ag)
        assert sum(r["bytes"] for r in ag) == 2 * sum(n * 2 // WORLD_SIZE for n in numels)
        assert all(r["dtype"] == "torch.float32" for r in rs)  # reduce_dtype
        assert sum(r["bytes"] for r in rs) == sum(n * 4 for n in numels)


def test_plain_all_reduce_with_reduce_op(results):
    (record,) = results[0]["plain"]["all_reduce_max"]
    assert record["kind"] == "all_reduce"
    assert record["op"] == "c10d.allreduce_.default"
    assert (record["dtype"], record["bytes"], record["reduce_op"]) == ("torch.float32", 12, "max")
    assert record["group_size"] == WORLD_SIZE
    assert isinstance(record["group_name"], str) and record["group_name"]


def test_functional_collectives(results):
    records = results[0]["plain"]["functional"]
    # wait_tensor / _wrap_tensor_autograd are not collectives and are not recorded
    assert _kinds(records) == ["all_reduce", "all_gather", "reduce_scatter"]
    assert [r["bytes"] for r in records] == [5 * 4, 3 * 2 * 4, 4 * 2 * 4]
    assert [r["reduce_op"] for r in records] == ["sum", None, "avg"]
    assert all(r["op"].startswith("_c10d_functional.") for r in records)
    assert all(r["group_size"] == WORLD_SIZE for r in records)
    assert all(isinstance(r["group_name"], str) and r["group_name"] for r in records)


def test_uint8_broadcast_barrier_and_scope(results):
    plain = results[0]["plain"]
    ag, bc, barrier = plain["uint8_broadcast_barrier"]
    assert (ag["kind"], ag["dtype"], ag["bytes"]) == ("all_gather", "torch.uint8", 6)
    assert (bc["kind"], bc["dtype"], bc["bytes"]) == ("broadcast", "torch.float64", 16)
    assert (barrier["kind"], barrier["bytes"]) == ("other", 0)
    assert plain["outside_count"] == 3


def test_kind_validation():
    counter = CollectiveCounter()
    assert counter.count() == 0 and counter.bytes(CollectiveKind.ALL_GATHER) == 0
    with pytest.raises(ValueError, match="unknown collective kind 'allgather'"):
        counter.count("allgather")
