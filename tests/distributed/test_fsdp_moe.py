"""FSDP2 + float8 all-gather of 3-D expert weights, on gloo.

A small MoE transformer (tests.models with a MoEArgs feed-forward) whose experts alone are
float8 (the linears stay fp32, so the expert bytes stand out), trained for 6 steps:
- losses equal, step by step, to a replicated single-process float8 reference with
  hand-averaged gradients (same seed, the same local batch: rowwise and grad_weight scales
  depend on which tokens a rank holds, so the reference holds the same ones);
- forward all-gather bytes = 1 per expert weight element plus 8 per expert row for rowwise
  (the row scales and their inverses ride in the same payload), 4 per element for the fp32
  rest; no amax all-reduce for rowwise experts;
- shard size 1 (HSDP (2, 1): FSDP2 skips the all-gather), uneven experts (3 on 2 ranks) with
  tensorwise, and the refusal of uneven rowwise on every rank (no hang);
- a DCP checkpoint saved after 2 steps and loaded into a fresh sharded model (the experts'
  weights stay float8-gathered) continues with the uninterrupted run's losses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard

from fsdp_float8 import Float8LinearConfig, convert_to_float8_training
from fsdp_float8.tools.comm_stats import CollectiveCounter
from tests.distributed.launcher import (
    DistributedError,
    cpu_mesh,
    replicated_losses,
    run_distributed,
)
from tests.models import MoEArgs, Transformer, model_args, moe_batch, moe_loss


@dataclass(frozen=True)
class MoECase:
    recipe: str = "rowwise"
    n_experts: int = 4
    mesh: tuple[int, ...] = (2,)  # (2,): FSDP over 2; (2, 1): HSDP, shard size 1
    steps: int = 6


def _model(case: MoECase) -> Transformer:
    moe = MoEArgs(n_experts=case.n_experts, top_k=2, hidden_dim=32)
    args = model_args("moe_tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, moe=moe)
    model = Transformer(args)
    model.init_weights(0)
    config = Float8LinearConfig.from_recipe_name(
        case.recipe, emulate=True, enable_fsdp_float8_all_gather=True
    )
    no_linears = lambda m, fqn: False  # only the experts in float8
    return convert_to_float8_training(model, config=config, module_filter_fn=no_linears)


def _expected_forward_bytes(model, shards: int, rowwise: bool) -> int:
    total = 0
    for name, p in model.named_parameters():
        rows = math.ceil(p.shape[0] / shards)
        numel = rows * math.prod(p.shape[1:])
        if ".experts." in name:
            total += numel + (8 * rows * p.shape[1] if rowwise else 0)
        else:
            total += 4 * numel
    return total


def _train_fsdp(case: MoECase, rank: int):
    names = ("replicate", "shard") if len(case.mesh) == 2 else ("shard",)
    mesh = cpu_mesh(case.mesh, names)
    model = _model(case)
    expected = _expected_forward_bytes(model, case.mesh[-1], case.recipe == "rowwise")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, counts = [], []
    for step in range(case.steps):
        with CollectiveCounter() as fwd:
            loss = moe_loss(model, moe_batch(step, rank))
        with CollectiveCounter() as bwd:
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        counts.append((fwd.bytes("all_gather"), fwd.count("all_reduce"), bwd.count("all_reduce")))
    return losses, counts, expected


def _train_reference(case: MoECase, rank: int, world_size: int) -> list[float]:
    return replicated_losses(
        _model(case), lambda m, step: moe_loss(m, moe_batch(step, rank)), case.steps
    )


def _grid(rank: int, world_size: int, cases: list[MoECase]):
    return [(_train_fsdp(c, rank), _train_reference(c, rank, world_size)) for c in cases]


ROWWISE = MoECase()
HSDP = MoECase(mesh=(2, 1))
TENSORWISE_UNEVEN = MoECase(recipe="tensorwise", n_experts=3)
CASES = [ROWWISE, HSDP, TENSORWISE_UNEVEN]


def test_fsdp_float8_experts_match_reference_and_send_one_byte(tmp_path):
    results = run_distributed(_grid, 2, tmp_path, CASES, timeout_s=300)
    for rank, per_case in enumerate(results):
        for case, ((losses, counts, expected), ref) in zip(CASES, per_case):
            # exact: the same casts on the same local tokens; 2-rank sums are order-free
            assert losses == ref, (case, rank, losses, ref)
            fwd_bytes = {b for b, _, _ in counts}
            if case.mesh == (2,):
                assert fwd_bytes == {expected}, (case, fwd_bytes, expected)
            else:  # shard size 1: FSDP2 gathers nothing
                assert fwd_bytes == {0}, (case, fwd_bytes)
            # amax all-reduces: none for rowwise; backward re-gathers (reshard after forward);
            # HSDP's backward all-reduces are its gradients across the replicas (3 groups)
            fwd_ar, bwd_ar = {c[1] for c in counts}, {c[2] for c in counts}
            if case.recipe == "rowwise":
                assert fwd_ar == {0} and bwd_ar == ({0} if case.mesh == (2,) else {3}), counts
            else:  # tensorwise: precomputed by the float8 step (in the optimizer step; the
                # first scales before the first forward)
                assert [c[1] for c in counts] == [1] + [0] * (len(counts) - 1), counts
                assert bwd_ar == {0}, counts


def _uneven_rowwise(rank: int, world_size: int):
    case = MoECase(n_experts=3)
    mesh = cpu_mesh(world_size)
    model = _model(case)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    moe_loss(model, moe_batch(0, rank))


def test_uneven_rowwise_experts_are_refused_on_every_rank(tmp_path):
    with pytest.raises(DistributedError, match="rowwise float8 all-gather of a weight with 3 rows"):
        run_distributed(_uneven_rowwise, 2, tmp_path, timeout_s=120)


def _sharded(case: MoECase, mesh):
    model = _model(case)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _steps(model, opt, rank: int, steps) -> list[float]:
    losses = []
    for step in steps:
        loss = moe_loss(model, moe_batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _resumed(rank: int, world_size: int, ckpt: str):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    case, mesh = MoECase(steps=4), cpu_mesh(world_size)
    model, opt = _sharded(case, mesh)
    first = _steps(model, opt, rank, range(2))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    uninterrupted = first + _steps(model, opt, rank, range(2, 4))
    fresh, fresh_opt = _sharded(case, mesh)
    msd, osd = get_state_dict(fresh, fresh_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(
        fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    wrapped = type(fresh.blocks[0].feed_forward.experts.w1.to_local()).__name__
    return uninterrupted[2:], _steps(fresh, fresh_opt, rank, range(2, 4)), wrapped


def test_dcp_checkpoint_of_float8_experts_loads_into_a_sharded_model(tmp_path):
    for uninterrupted, resumed, wrapped in run_distributed(
        _resumed, 2, tmp_path, str(tmp_path / "ckpt"), timeout_s=300
    ):
        assert resumed == uninterrupted, (resumed, uninterrupted)
        assert wrapped == "DynamicFloat8Weight", wrapped
