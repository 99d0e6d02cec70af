"""Ranks that disagree get an error on every rank, never a hang or silently wrong training.

On 2 gloo ranks, each case makes rank 1 differ from rank 0 and runs one training step with
no float8 call in the loop; the first refresh (the converted root's forward pre-hook)
gathers a fixed-length config fingerprint and raises a ValueError naming the field and the
ranks. A short per-test timeout turns a hang (what the old code did) into a failure.
"""

from __future__ import annotations

import io
import os
import sys
from dataclasses import replace
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_float8 import (
    CastConfig,
    Float8LinearConfig,
    convert_to_float8_training,
    float8_step,
    precompute_float8_dynamic_scale_for_fsdp,
    sync_float8_amax_and_scale_history,
)
from tests.distributed.float8_cases import Case, batch, build_model, loss_of, shard
from tests.distributed.launcher import cpu_mesh, run_distributed

MLP = Case(model="mlp", n_layers=1, dim=64)
TENSORWISE = Float8LinearConfig.tensorwise(enable_fsdp_float8_all_gather=True)
ROWWISE = Float8LinearConfig.rowwise(enable_fsdp_float8_all_gather=True)
DELAYED = Float8LinearConfig(
    cast_config_input=CastConfig(scaling_type="delayed"),
    cast_config_weight=CastConfig(scaling_type="delayed"),
    cast_config_grad_output=CastConfig(scaling_type="delayed"),
    enable_fsdp_float8_all_gather=True,
)


def _static(weight_scale: float) -> Float8LinearConfig:
    s = CastConfig(scaling_type="static", static_scale=64.0)
    return Float8LinearConfig(
        cast_config_input=s,
        cast_config_weight=CastConfig(scaling_type="static", static_scale=weight_scale),
        cast_config_grad_output=CastConfig(scaling_type="static", static_scale=2.0**20),
        enable_fsdp_float8_all_gather=True,
    )


# name -> (rank 0's config, rank 1's config, a field the error must name)
DISAGREE = {
    "recipe": (TENSORWISE, ROWWISE, "cast_config_input"),
    "scaling_type": (TENSORWISE, DELAYED, "cast_config_weight"),
    "fp8_all_gather_on_one_rank": (
        TENSORWISE,
        replace(TENSORWISE, enable_fsdp_float8_all_gather=False),
        "enable_fsdp_float8_all_gather",
    ),
    "static_scale": (_static(2048.0), _static(1024.0), "cast_config_weight"),
}


def _one_step(rank, world_size, config):
    model = build_model(MLP)
    convert_to_float8_training(model, config=config)
    shard(model, MLP, cpu_mesh(world_size))
    loss_of(model, MLP, batch(MLP, 0, rank, world_size)).backward()
    return model


def _disagreeing_configs(rank, world_size):
    out = {}
    for name, configs in DISAGREE.items():
        try:
            _one_step(rank, world_size, configs[rank])
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def test_different_configs_raise_on_every_rank(tmp_path):
    results = run_distributed(_disagreeing_configs, 2, tmp_path, timeout_s=90)
    for rank, messages in enumerate(results):
        for name, (_, _, field) in DISAGREE.items():
            msg = messages[name]
            assert msg is not None, f"rank {rank}: {name} trained on"
            assert f"{field}: ranks [0] vs [1]" in msg, (rank, name, msg)
            assert "same Float8LinearConfig" in msg


# name -> (rank 0's model, rank 1's model, the field the error must name): the same float8
# config on both, weights of another shape or dtype (FSDP2's all-gathers would not match)
SHAPES = {
    "weight_shape": ((64, torch.float32), (32, torch.float32)),
    "weight_dtype": ((64, torch.float32), (64, torch.bfloat16)),
}


def _disagreeing_models(rank, world_size):
    out = {}
    for field, models in SHAPES.items():
        dim, dtype = models[rank]
        case = replace(MLP, dim=dim)
        model = build_model(case).to(dtype)
        convert_to_float8_training(model, config=TENSORWISE)
        shard(model, case, cpu_mesh(world_size))
        try:
            loss_of(model, case, batch(case, 0, rank, world_size).to(dtype)).backward()
            out[field] = None
        except ValueError as e:
            out[field] = str(e)
    return out


def test_different_weight_shapes_or_dtypes_raise_on_every_rank(tmp_path):
    results = run_distributed(_disagreeing_models, 2, tmp_path, timeout_s=90)
    for rank, messages in enumerate(results):
        for field in SHAPES:
            msg = messages[field]
            assert msg is not None, f"rank {rank}: {field} trained on"
            assert f"{field}: ranks [0] vs [1]" in msg, (rank, field, msg)
            assert "same model" in msg


class _Branchy(nn.Module):
    """Two delayed layers; `skip` leaves the second out of the forward (on one rank)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x, skip: bool = False):
        x = self.a(x)
        return x if skip else self.b(x)


def _skipped_layer(rank, world_size):
    torch.manual_seed(0)
    config = replace(DELAYED, enable_fsdp_float8_all_gather=False)
    model = convert_to_float8_training(_Branchy(), config=config)
    sync_float8_amax_and_scale_history(model, group=dist.group.WORLD)  # seed; remembered
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model(torch.randn(4, 32), skip=rank == 1).sum().backward()
    try:
        opt.step()  # the float8 step's sync finds layer b ran on rank 0 only
    except ValueError as e:
        return str(e)
    return None


def test_a_rank_that_skipped_a_layer_gets_an_error(tmp_path):
    for rank, msg in enumerate(run_distributed(_skipped_layer, 2, tmp_path, timeout_s=60)):
        assert msg is not None and "['b']" in msg and "some ranks but not" in msg, (rank, msg)


def _stay_until_all_done(rank, world_size):
    """Keep this rank's process up until every rank got here (at most 20 s), so that a peer
    blocked in a collective stays blocked instead of failing on a closed connection."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"done/{rank}", "1")
    try:
        store.wait([f"done/{r}" for r in range(world_size)], timedelta(seconds=20))
    except RuntimeError:
        pass


def _converted_later_on_one_rank(rank, world_size):
    torch.manual_seed(0)
    config = replace(DELAYED, enable_fsdp_float8_all_gather=False)
    model = convert_to_float8_training(
        _Branchy(), config=config, module_filter_fn=lambda m, fqn: fqn != "b"
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    msg = None
    try:
        for step in range(3):
            if step == 1 and rank == 1:  # rank 1 alone converts layer b after a step
                convert_to_float8_training(model, config=config)
            sync_float8_amax_and_scale_history(model, group=dist.group.WORLD)
            model(torch.randn(4, 32)).sum().backward()
            opt.step()
    except ValueError as e:
        msg = str(e)
    _stay_until_all_done(rank, world_size)
    return msg


def test_a_layer_converted_later_on_one_rank_gets_an_error_on_every_rank(tmp_path):
    """Each rank raises the ValueError itself: the rank whose layers had been checked before
    does not go on into a refresh collective its peer never joins."""
    results = run_distributed(_converted_later_on_one_rank, 2, tmp_path, timeout_s=90)
    for rank, msg in enumerate(results):
        assert msg is not None and "float8_layers: ranks [0] vs [1]" in msg, (rank, msg)
        assert "ranks [0] had checked their float8 layers before" in msg, (rank, msg)


def _precompute_on_rank_0_only(rank, world_size):
    model = _one_step(rank, world_size, TENSORWISE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    if rank == 0:
        precompute_float8_dynamic_scale_for_fsdp(model)
    loss = loss_of(model, MLP, batch(MLP, 1, rank, world_size))  # rank 1's hook matches it
    loss.backward()
    scales = [
        m.weight._local_tensor.fresh_stamped_scale().item()
        for m in model.modules()
        if hasattr(m, "weight") and hasattr(m.weight, "_local_tensor")
    ]
    return loss.item(), scales


def test_precompute_on_one_rank_only_is_matched_by_the_hook(tmp_path):
    r0, r1 = run_distributed(_precompute_on_rank_0_only, 2, tmp_path, timeout_s=60)
    assert r0[1] == r1[1] and len(r0[1]) == 2 * MLP.n_layers


# -- a refresh one rank starts alone: an error naming the missing ranks, not a gloo abort ------
def _error_of(fn, *args) -> str | None:
    try:
        fn(*args)
    except RuntimeError as e:  # rank 0: the handshake; rank 1: gloo once rank 0 has left
        return str(e)
    return None


def _never_converted(rank, world_size):
    os.environ["FSDP_FLOAT8_RANK_WAIT_S"] = "5"  # a notice after 2.5 s, the error after 5

    def run():
        model = build_model(MLP)
        if rank == 0:  # rank 1 forgot to convert: its all-gathers carry bf16 weights
            convert_to_float8_training(model, config=TENSORWISE)
        shard(model, MLP, cpu_mesh(world_size))
        loss_of(model, MLP, batch(MLP, 0, rank, world_size)).backward()

    sys.stderr = io.StringIO()
    return _error_of(run), sys.stderr.getvalue()


def test_a_rank_that_never_converted_gets_an_error(tmp_path):
    (rank0, said0), (rank1, _) = run_distributed(_never_converted, 2, tmp_path, timeout_s=90)
    assert rank0 is not None and "ranks [1] of [0, 1], which never reached it" in rank0, rank0
    assert "convert_to_float8_training before fully_shard" in rank0
    assert rank1 is not None  # a Python error (the peer left), not a signal
    # while it waits, rank 0 says once what for (the default wait is 30 minutes)
    notices = [line for line in said0.splitlines() if "fsdp_float8: rank 0 is waiting" in line]
    assert len(notices) == 1, said0
    assert "for ranks [1] of [0, 1]" in notices[0] and "waiting up to 5 s" in notices[0]


def _skipped_step(rank, world_size):
    os.environ["FSDP_FLOAT8_RANK_WAIT_S"] = "5"
    model = _one_step(rank, world_size, TENSORWISE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def run():
        if rank == 1:  # rank 0 skips the step (e.g. its own loss was not finite)
            opt.step()  # the float8 step's refresh: rank 0 does not join it
        loss_of(model, MLP, batch(MLP, 1, rank, world_size)).backward()

    return _error_of(run)


def test_an_optimizer_step_on_one_rank_only_gets_an_error(tmp_path):
    rank0, rank1 = run_distributed(_skipped_step, 2, tmp_path, timeout_s=90)
    assert rank1 is not None and "ranks [0] of [0, 1], which never reached it" in rank1, rank1
    assert "refresh (after optimizer step)" in rank1 and "optimizer.step() that some" in rank1
    assert rank0 is not None  # a Python error (the peer left), not gloo's abort


def _one_rank_alone(rank, world_size, how):
    os.environ["FSDP_FLOAT8_RANK_WAIT_S"] = "5"
    model = _one_step(rank, world_size, TENSORWISE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if how == "precompute, step off":
        float8_step(model).disable()
    opt.step()

    def alone():
        if rank == 0:
            if how == "precompute, step off":
                precompute_float8_dynamic_scale_for_fsdp(model)  # stale: a refresh
            else:  # an in-place rollback on rank 0 only, then the next training forward
                with torch.no_grad():
                    for t in model.state_dict().values():
                        t.to_local().mul_(0.5)
                loss_of(model, MLP, batch(MLP, 1, rank, world_size))
        dist.all_reduce(torch.ones(1))  # rank 1: e.g. logging the loss

    return _error_of(alone)


@pytest.mark.parametrize("how", ["precompute, step off", "in-place write on one rank"])
def test_a_refresh_on_one_rank_alone_gets_an_error(tmp_path, how):
    rank0, rank1 = run_distributed(_one_rank_alone, 2, tmp_path, how, timeout_s=90)
    assert rank0 is not None and "ranks [1] of [0, 1], which never reached it" in rank0, rank0
    assert "on some ranks only" in rank0
    assert rank1 is not None
