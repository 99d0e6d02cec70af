"""NVFP4 experts under FSDP2 on 2 gloo ranks, the 3-D expert weights all-gathered as NVFP4.

A small MoE transformer (tests.models, torchtitan-style GroupedExperts) whose experts alone
are NVFP4 (`NVFP4Config(enable_fsdp_float8_all_gather=True)`; the linears stay fp32), each
block's experts sharded on their own, trained for 3 steps:
- losses equal, bit for bit, to a replicated single-process reference with the same
  NVFP4 experts and hand-averaged gradients (each expert is quantized with its own amax,
  local to the dim-0 shard that holds it; the draws depend on the gradients and the
  experts' names, not on the rank); also with four-over-six, and at shard size 1 (HSDP
  (2, 1): FSDP2 gathers nothing and the tile and tensor factors ride in the metadata);
- the experts' all-gathers send, per rank and gathered element, 0.5 + 1/256 bytes (packed
  codes, one e4m3 byte per 16x16 tile) plus 4 bytes per expert (its float32 tensor
  factor), counted per collective: the experts' all-gathers are the ones whose input is
  uint8; and no amax all-reduce (the factors are local to each shard);
- a DCP checkpoint (plain high-precision weights) saved after 2 steps and loaded into a
  fresh sharded model continues with the reference's loss;
- the expert weights are quantized once per step on each rank (its shard, packed for
  forward's all-gather and sent again by backward's re-gather); the GEMMs read the
  gathered record as it is;
- experts sharded as Shard(1) (a shard splits every expert) are refused on every rank at
  their first all-gather, naming the weight and Shard(0).
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from fsdp_float8 import NVFP4Config, convert_to_float8_training
from fsdp_float8.core import nvfp4
from fsdp_float8.tools.comm_stats import CollectiveCounter
from tests.distributed.launcher import (
    DistributedError,
    cpu_mesh,
    replicated_losses,
    run_distributed,
)
from tests.models import MoEArgs, Transformer, model_args, moe_batch, moe_loss

STEPS, N_EXPERTS = 3, 4


def _model(**config) -> Transformer:
    moe = MoEArgs(n_experts=N_EXPERTS, top_k=2, hidden_dim=32)
    args = model_args("moe_tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, moe=moe)
    model = Transformer(args)
    model.init_weights(0)
    nvfp4 = NVFP4Config(enable_fsdp_float8_all_gather=True, **config)
    no_linears = lambda m, fqn: False  # only the experts in NVFP4
    return convert_to_float8_training(model, config=nvfp4, module_filter_fn=no_linears)


def _expert_bytes_per_gather(model, shards: int) -> int:
    """This rank's all-gather input bytes for one gather of every expert weight."""
    total = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            experts = p.shape[0] // shards
            total += experts * math.prod(p.shape[1:]) * (0.5 + 1 / 256) + 4 * experts
    return int(total)


def _sharded(mesh, **config):
    model = _model(**config)
    for block in model.blocks:
        fully_shard(block.feed_forward.experts, mesh=mesh)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_fsdp(rank: int, mesh_shape: tuple[int, ...], steps=range(STEPS), model_opt=None, **config) -> dict:  # fmt: skip
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = cpu_mesh(mesh_shape, names)
    model, opt = model_opt or _sharded(mesh, **config)
    elements = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    expected = _expert_bytes_per_gather(_model(**config), mesh_shape[-1])
    losses, uint8_bytes, amax_reduces = [], [], []
    for step in steps:
        with CollectiveCounter() as counter:
            loss = moe_loss(model, moe_batch(step, rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
        gathers = [r for r in counter.records if str(r.kind) == "all_gather"]
        uint8_bytes.append(sum(r.bytes for r in gathers if r.dtype == torch.uint8))
        amax_reduces.append(
            sum(1 for r in counter.records if str(r.kind) == "all_reduce" and r.reduce_op == "max")
        )
    return {
        "losses": losses,
        "uint8_bytes": uint8_bytes,
        "expected_per_gather": expected,
        "elements": elements,
        "amax_reduces": amax_reduces,
    }


def _train_reference(rank: int, world: int, **config) -> list[float]:
    return replicated_losses(
        _model(**config), lambda m, step: moe_loss(m, moe_batch(step, rank)), STEPS
    )


def _resumed(rank: int, world: int, ckpt: str) -> list[float]:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = cpu_mesh(world)
    model, opt = _sharded(mesh)
    _train_fsdp(rank, (world,), range(2), (model, opt))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    fresh, fresh_opt = _sharded(mesh)
    msd, osd = get_state_dict(fresh, fresh_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(
        fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return _train_fsdp(rank, (world,), range(2, STEPS), (fresh, fresh_opt))["losses"]


def _grid(rank: int, world: int, ckpt: str) -> dict:
    fos = {"four_over_six": True}
    return {
        "resumed": _resumed(rank, world, ckpt),
        "fsdp": _train_fsdp(rank, (world,)),
        "reference": _train_reference(rank, world),
        "hsdp_shard_1": _train_fsdp(rank, (world, 1))["losses"],
        "fsdp_4over6": _train_fsdp(rank, (world,), **fos)["losses"],
        "reference_4over6": _train_reference(rank, world, **fos),
    }


def test_nvfp4_experts_gather_fp4_and_train_as_the_reference(tmp_path):
    for out in run_distributed(_grid, 2, tmp_path, str(tmp_path / "ckpt"), timeout_s=400):
        fsdp = out["fsdp"]
        assert fsdp["losses"] == out["reference"], out
        assert out["resumed"] == out["reference"][2:], out
        assert out["hsdp_shard_1"] == out["reference"], out
        assert out["fsdp_4over6"] == out["reference_4over6"], out
        assert out["fsdp_4over6"] != out["reference"], out  # four-over-six did act
        # each expert weight gathered for forward and again for backward (reshard after
        # forward): two gathers per step of this rank's half of the experts
        per_step = 2 * fsdp["expected_per_gather"]
        assert fsdp["uint8_bytes"] == [per_step] * STEPS, (fsdp["uint8_bytes"], per_step)
        factors = 2 * 4 * (N_EXPERTS // 2) * 6  # 6 expert weights, 4 bytes per expert
        per_element = (per_step - factors) / fsdp["elements"]  # per gathered element
        assert per_element == 0.5 + 1 / 256, per_element
        assert fsdp["amax_reduces"] == [0] * STEPS, fsdp["amax_reduces"]


def _split_experts(rank: int, world: int) -> None:
    mesh = cpu_mesh(world)
    model = _model()
    for block in model.blocks:
        fully_shard(block.feed_forward.experts, mesh=mesh, shard_placement_fn=lambda p: Shard(1))
    fully_shard(model, mesh=mesh)
    moe_loss(model, moe_batch(0, rank))


def test_shards_that_split_an_expert_are_refused_on_every_rank(tmp_path):
    with pytest.raises(DistributedError, match=r"sharded as Shard\(1\)") as err:
        run_distributed(_split_experts, 2, tmp_path, timeout_s=120)
    assert "Shard(0)" in str(err.value) and "NVFP4ExpertsFSDPWeight" in str(err.value)


def _quantizations(rank: int, world: int) -> list[int]:
    """Expert weight quantizations (`nvfp4.quantize_per_matrix` calls) per step."""
    mesh = cpu_mesh(world)
    model = _model()
    for block in model.blocks:
        fully_shard(block.feed_forward.experts, mesh=mesh)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    real, count = nvfp4.quantize_per_matrix, [0]

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    per_step = []
    with mock.patch.object(nvfp4, "quantize_per_matrix", counting):
        for step in range(STEPS):
            count[0] = 0
            moe_loss(model, moe_batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
            per_step.append(count[0])
    return per_step


def test_each_expert_shard_is_quantized_once_per_step(tmp_path):
    for out in run_distributed(_quantizations, 2, tmp_path, timeout_s=200):
        assert out == [6] * STEPS, out  # 3 weights in each of 2 blocks
