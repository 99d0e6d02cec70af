"""Float8 TP 2 x FSDP2 2 on a ("dp", "tp") mesh of 4 gloo ranks, one spawn:

- parity: FSDP2 over mesh["dp"] of the TP-planned Llama model, float8 all-gather of the
  TP-local weight shards, equals the single-process float8 reference (each dp slice in
  turn, gradients averaged) for 6 steps, tensorwise and rowwise, to the reduction-order
  tolerance of test_fsdp_parity (two references that sum tokens in different orders);
- collectives of a steady step (tensorwise): the float8 refresh is ONE MAX all-reduce over
  all 4 ranks (the weights' scales cover their dp and tp shards) before the forward, none in
  backward; the weights cross the dp group at 1 byte per float8 element (4 for the rest);
  the sequence-parallel activations cross the tp group at 1 byte per element.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_float8 import Float8Linear
from fsdp_float8.tools.comm_stats import CollectiveCounter
from tests.distributed.launcher import cpu_mesh, run_distributed
from tests.distributed.test_fsdp_parity import order_tolerances
from tests.distributed.tp_cases import (
    TPCase,
    global_batch,
    loss_of,
    parallelize,
    train_parallel,
    train_reference,
)

PARITY = [TPCase(recipe=r, dp=2, fp8_all_gather=True) for r in ("tensorwise", "rowwise")]


def _grid(rank: int, world_size: int) -> dict:
    mesh = cpu_mesh((2, 2), ("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    parity = [
        (
            train_parallel(c, mesh),
            [train_reference(c, dp_rank), train_reference(c, dp_rank, reverse_rows=True)],
        )
        for c in PARITY
    ]
    return {"parity": parity, "comm": _steady_step(PARITY[0], mesh)}


def _steady_step(case: TPCase, mesh) -> dict:
    model = parallelize(case, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp_rank = mesh["dp"].get_local_rank()
    fp8_ids = {id(m.weight) for m in model.modules() if isinstance(m, Float8Linear)}
    weight_bytes = sum(
        p.to_local().numel() * (1 if id(p) in fp8_ids else p.element_size())
        for p in model.parameters()
    )
    for step in range(2):  # the first refresh also checks the ranks' configs: count step 2
        tokens = global_batch(case, step)[dp_rank * case.rows : (dp_rank + 1) * case.rows]
        with CollectiveCounter() as fwd:
            loss = loss_of(model, tokens)
        with CollectiveCounter() as bwd:
            loss.backward()
        with CollectiveCounter() as optim:
            opt.step()
        opt.zero_grad()
    groups = {"dp": mesh["dp"].get_group().group_name, "tp": mesh["tp"].get_group().group_name}

    def summary(c: CollectiveCounter) -> dict:
        gathers = [r for r in c.records if str(r.kind) == "all_gather"]
        return {
            "world_max": sum(1 for r in c.records if r.reduce_op == "max" and r.group_size == 4),
            "dp_gather_bytes": sum(r.bytes for r in gathers if r.group_name == groups["dp"]),
            "tp_uint8_gathers": [
                r.bytes for r in gathers if r.group_name == groups["tp"] and r.dtype == torch.uint8
            ],
        }

    return {
        "fwd": summary(fwd),
        "bwd": summary(bwd),
        "opt": summary(optim),
        "weight_bytes": weight_bytes,
        "shard": (case.rows, 8, 64),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_grid, 4, tmp_path_factory.mktemp("tp2d"), timeout_s=600)


def test_tp_fsdp_parity_with_single_process(results):
    for rank, res in enumerate(results):
        for case, (got_losses, refs) in zip(PARITY, res["parity"], strict=True):
            tols = order_tolerances(refs)
            for t, (got, want, tol) in enumerate(zip(got_losses, refs[0], tols)):
                assert abs(got - want) <= tol, f"rank {rank} {case.name} step {t}: {got} vs {want}"
    # the two ranks of a TP group compute the same losses
    assert results[0]["parity"] == results[1]["parity"]
    assert results[2]["parity"] == results[3]["parity"]


def test_tp_fsdp_steady_step_collectives(results):
    comm = results[0]["comm"]
    # the float8 step refreshes after optimizer.step(): one all-reduce over all 4 ranks there,
    # none in forward or backward
    assert comm["fwd"]["world_max"] == 0
    assert comm["bwd"]["world_max"] == 0
    assert comm["opt"]["world_max"] == 1
    # forward gathers every parameter once, backward again after reshard (not the root's)
    assert comm["fwd"]["dp_gather_bytes"] == comm["weight_bytes"]
    assert 0 < comm["bwd"]["dp_gather_bytes"] < comm["weight_bytes"]
    rows, seq_shard, dim = comm["shard"]
    assert comm["fwd"]["tp_uint8_gathers"] == [rows * seq_shard * dim] * (2 * TPCase().n_layers)
    assert comm["bwd"]["tp_uint8_gathers"] == []
