"""Delayed scaling: history rolling, scale_fn, the bootstrap before the first sync, the
forgotten-sync guard, and state_dict round trips of the delayed buffers."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import fsdp_float8  # noqa: F401  (safe globals for weights_only loading)
from fsdp_float8 import (
    CastConfig,
    DelayedScalingConfig,
    Float8Linear,
    Float8LinearConfig,
    Operand,
    convert_to_float8_training,
    sync_float8_amax_and_scale_history,
)
from fsdp_float8.core.config import E4M3, E5M2
from fsdp_float8.core.scaling import amax_to_scale
from tests.unit.float8_helpers import make_config, make_linear, warm_up

DELAYED = CastConfig(scaling_type="delayed")
BUFFER_KINDS = ("fp8_amax_", "fp8_amax_history_", "fp8_scale_", "fp8_initialized_")


def _config(**delayed) -> Float8LinearConfig:
    return Float8LinearConfig(
        cast_config_input=DELAYED,
        cast_config_weight=DELAYED,
        cast_config_grad_output=DELAYED,
        delayed_scaling_config=DelayedScalingConfig(**delayed),
    )


def _layer(seed: int = 0, **delayed) -> Float8Linear:
    torch.manual_seed(seed)
    return Float8Linear(64, 32, config=_config(**delayed))


def _step(mod: nn.Module, x: torch.Tensor, sync: bool = True) -> torch.Tensor:
    out = mod(x)
    out.backward(torch.ones_like(out))
    if sync:
        sync_float8_amax_and_scale_history(mod)
    return out.detach()


def test_an_all_zero_operand_keeps_the_synced_scale() -> None:
    """A step whose input is all zeros (amax 0) pushes nothing: the next step scales as the
    one before (an amax of 0 would give the largest scale, saturating the next input)."""
    mod = _layer(history_len=3, scale_fn_name="most_recent")
    _step(mod, torch.randn(4, 64))
    state = mod.delayed_scaling
    history, scale = state.fp8_amax_history_input.clone(), state.fp8_scale_input.clone()
    _step(mod, torch.zeros(4, 64))
    assert torch.equal(state.fp8_amax_history_input, history)
    assert torch.equal(state.fp8_scale_input, scale)
    # the next non-zero input rolls as usual
    x = torch.zeros(4, 64)
    x[0, 0] = 3.0
    _step(mod, x)
    assert state.fp8_amax_history_input[0].item() == 3.0


def test_buffers_are_registered_float32() -> None:
    mod = _layer(history_len=5)
    for op in Operand:
        for kind in BUFFER_KINDS:
            buf = getattr(mod.delayed_scaling, f"{kind}{op.value}")
            want = torch.bool if kind == "fp8_initialized_" else torch.float32
            assert buf.dtype == want
        assert getattr(mod.delayed_scaling, f"fp8_amax_history_{op.value}").shape == (5,)
    assert not mod.delayed_scaling.ready
    assert Float8Linear(64, 32).delayed_scaling is None  # dynamic layers have no buffers
    assert not any(n.startswith("fp8_") for n, _ in Float8Linear(64, 32).named_buffers())


def test_history_rolls_and_amax_resets() -> None:
    mod = _layer(history_len=3)
    amaxes = [2.0, 5.0, 3.0, 1.0]
    for a in amaxes:
        x = torch.zeros(4, 64)
        x[0, 0] = a
        _step(mod, x)
    # newest first, the oldest (2.0) rolled out of a history of 3
    torch.testing.assert_close(
        mod.delayed_scaling.fp8_amax_history_input, torch.tensor([1.0, 3.0, 5.0])
    )
    assert mod.delayed_scaling.fp8_amax_input.item() == 0.0  # reset after each sync
    assert mod.delayed_scaling.fp8_initialized_input.item() and mod.delayed_scaling.ready
    torch.testing.assert_close(
        mod.delayed_scaling.fp8_scale_input, amax_to_scale(torch.tensor(5.0), E4M3)
    )
    w_amax = mod.weight.detach().abs().amax()
    torch.testing.assert_close(mod.delayed_scaling.fp8_amax_history_weight[0], w_amax)
    # grad_output of ones: amax 1, scaled for e5m2
    torch.testing.assert_close(
        mod.delayed_scaling.fp8_scale_grad_output, amax_to_scale(torch.tensor(1.0), E5M2)
    )


@pytest.mark.parametrize("scale_fn, expected_amax", [("max", 4.0), ("most_recent", 1.0)])
def test_scale_fn(scale_fn: str, expected_amax: float) -> None:
    mod = _layer(scale_fn_name=scale_fn)
    for a in (4.0, 1.0):
        _step(mod, torch.full((2, 64), a))
    torch.testing.assert_close(
        mod.delayed_scaling.fp8_scale_input, amax_to_scale(torch.tensor(expected_amax), E4M3)
    )


def test_before_first_sync_operands_scale_by_their_own_amax() -> None:
    delayed, dynamic = _layer(seed=1), Float8Linear(64, 32, config=Float8LinearConfig())
    dynamic.load_state_dict(delayed.state_dict(), strict=False)
    x = torch.randn(3, 5, 64) * 7
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [m(xi) for m, xi in zip((delayed, dynamic), xs)]
    for out in outs:
        out.backward(torch.ones_like(out) * 3)
    # bootstrap == dynamic tensorwise, bit for bit, in forward and backward
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=0, atol=0)
    torch.testing.assert_close(delayed.weight.grad, dynamic.weight.grad, rtol=0, atol=0)
    assert not delayed.delayed_scaling.fp8_initialized_input.item()
    assert delayed.delayed_scaling.fp8_amax_input.item() == pytest.approx(x.abs().amax().item())


def test_after_sync_the_stale_scale_is_used() -> None:
    mod = _layer()
    _step(mod, torch.full((2, 64), 0.5))  # history: input amax 0.5
    x = torch.randn(2, 64) * 10  # far larger than the history says: saturates
    out = mod(x).detach()
    dyn = Float8Linear(64, 32, config=Float8LinearConfig())
    dyn.load_state_dict(mod.state_dict(), strict=False)
    assert not torch.allclose(out, dyn(x), rtol=0.05, atol=0.05)
    assert mod.delayed_scaling.fp8_amax_input.item() == pytest.approx(
        x.abs().amax().item()
    )  # recorded


def _converted(**delayed) -> nn.Module:
    torch.manual_seed(0)
    return convert_to_float8_training(nn.Sequential(nn.Linear(64, 32)), config=_config(**delayed))


def test_forgotten_sync_raises_after_the_limit() -> None:
    # no optimizer step between the forwards: the automatic refresh has nothing to sync,
    # so the converted root's hook counts them
    mod = _converted(max_forwards_without_sync=3)
    x = torch.randn(2, 64)
    for _ in range(3):
        _step(mod, x, sync=False)
    with pytest.raises(RuntimeError, match=r"4 training forwards since the last") as info:
        mod(x)
    assert "sync_float8_amax_and_scale_history(model)" in str(info.value)
    assert "max_forwards_without_sync" in str(info.value)
    sync_float8_amax_and_scale_history(mod)
    for _ in range(3):  # the sync resets the count
        _step(mod, x, sync=False)


def test_an_optimizer_step_syncs_automatically() -> None:
    mod = _converted(max_forwards_without_sync=2)
    opt = torch.optim.SGD(mod.parameters(), lr=1e-3)
    for i in range(6):  # far past the limit: each optimizer step syncs
        _step(mod, torch.randn(2, 64) * (i + 1), sync=False)
        opt.step()
    state = mod[0].delayed_scaling
    assert state.ready and state.syncs == 6  # one per optimizer step (one process: no seed)
    assert (state.fp8_amax_history_input[:5] > 0).all()


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(64, 32)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def test_activation_checkpoint_recompute_is_not_a_training_forward() -> None:
    torch.manual_seed(0)
    model = convert_to_float8_training(_Checkpointed(), config=_config(max_forwards_without_sync=2))
    x = torch.randn(2, 64)
    _step(model, x, sync=False)
    _step(model, x, sync=False)  # 2 forwards (+ 2 recomputes in backward): at the limit
    state = model.inner.delayed_scaling
    assert state.fp8_amax_input.item() == pytest.approx(x.abs().amax().item())
    with pytest.raises(RuntimeError, match="3 training forwards"):
        model(x)


def test_no_grad_and_eval_forwards_do_not_count() -> None:
    mod = _converted(max_forwards_without_sync=2)
    x = torch.randn(2, 64)
    for _ in range(5):
        with torch.no_grad():
            mod(x)
        with torch.inference_mode():
            mod(x)
    mod.eval()
    for _ in range(5):
        mod(x)
    mod.train()
    _step(mod, x, sync=False)
    _step(mod, x, sync=False)
    with pytest.raises(RuntimeError, match="3 training forwards"):
        mod(x)


def test_eval_forwards_do_not_feed_the_history() -> None:
    mod = _layer()
    _step(mod, torch.randn(2, 64))
    before = {n: b.clone() for n, b in mod.named_buffers()}
    with torch.no_grad():
        mod(torch.randn(2, 64) * 1000)
    mod.eval()
    mod(torch.randn(2, 64) * 1000)
    for name, buf in mod.named_buffers():
        assert torch.equal(buf, before[name]), name


def _trained(seed: int = 0, steps: int = 3) -> Float8Linear:
    mod = _layer(seed=seed, history_len=4)
    for i in range(steps):
        _step(mod, torch.randn(2, 8, 64) * (i + 1))
    return mod


def test_state_dict_round_trip_with_weights_only_load() -> None:
    mod = _trained()
    state = mod.state_dict()
    for op in Operand:
        assert all(f"delayed_scaling.{kind}{op.value}" in state for kind in BUFFER_KINDS)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)

    fresh = _layer(seed=1, history_len=4)
    assert not fresh.delayed_scaling.ready
    fresh.load_state_dict(loaded)
    assert fresh.delayed_scaling.ready  # refreshed by the load hook
    for name, value in mod.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], value, rtol=0, atol=0)
    x = torch.randn(2, 8, 64) * 5
    torch.testing.assert_close(fresh(x), mod(x), rtol=0, atol=0)


def test_loading_an_unsynced_state_is_not_ready() -> None:
    unsynced = _layer(seed=2, history_len=4)
    _step(unsynced, torch.randn(2, 64), sync=False)
    fresh = _trained()
    assert fresh.delayed_scaling.ready
    fresh.load_state_dict(unsynced.state_dict())
    assert not fresh.delayed_scaling.ready


def test_buffers_stay_float32_after_to_bfloat16() -> None:
    mod = _trained()
    scale_before = mod.delayed_scaling.fp8_scale_input.clone()
    model = nn.Sequential(mod).to(torch.bfloat16)
    assert mod.weight.dtype == torch.bfloat16
    for name, buf in mod.named_buffers():
        want = torch.bool if "fp8_initialized_" in name else torch.float32
        assert buf.dtype == want, name
    torch.testing.assert_close(mod.delayed_scaling.fp8_scale_input, scale_before, rtol=0, atol=0)
    out = _step(model, torch.randn(2, 8, 64, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert mod.delayed_scaling.fp8_amax_history_input.dtype == torch.float32


def test_sync_counts_every_delayed_operand_of_every_layer() -> None:
    model = nn.Sequential(_layer(), nn.ReLU(), Float8Linear(32, 32), _layer(seed=3))
    model[3] = Float8Linear(32, 16, config=make_config("rowwise", "delayed"))
    model(torch.randn(2, 64)).sum().backward()
    # 3 operands of layer 0, none of the dynamic layer, the weight of the rowwise one
    assert sync_float8_amax_and_scale_history(model) == 3 + 1
    assert model[0].delayed_scaling.ready and model[3].delayed_scaling.ready


def test_sync_group_without_a_delayed_layer_is_refused() -> None:
    # only delayed amaxes are reduced over `group`: on a model with no delayed layer it
    # would change nothing, so it is refused naming the remedy; without it the call is a no-op
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dynamic = nn.Sequential(Float8Linear(32, 32), nn.ReLU(), Float8Linear(32, 16))
    assert sync_float8_amax_and_scale_history(dynamic) == 0
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="holds no delayed-scaling layer") as info:
            sync_float8_amax_and_scale_history(dynamic, group=dist.group.WORLD)
        assert "drop group" in str(info.value)
        delayed = nn.Sequential(_layer(), nn.ReLU(), Float8Linear(32, 16))
        assert sync_float8_amax_and_scale_history(delayed, group=dist.group.WORLD) == 3
    finally:
        dist.destroy_process_group()


def test_warm_up_helper_makes_delayed_ready() -> None:
    mod = make_linear(make_config("tensorwise", "delayed"))
    warm_up(mod, steps=2)
    assert mod.delayed_scaling.ready and (mod.delayed_scaling.fp8_amax_history_input[:2] > 0).all()
    assert mod.delayed_scaling.fp8_amax_history_input[2:].eq(0).all()


def test_meta_init_then_to_empty_gives_fresh_delayed_buffers() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 48))
    config = make_config("tensorwise", "delayed")
    convert_to_float8_training(model, config=config)
    model.to_empty(device="cpu")
    layer = model[0]
    for op in layer.delayed_scaling.operands:
        state = layer.delayed_scaling.view(op)
        assert state.amax.item() == 0 and not state.initialized.item()
        assert torch.equal(state.amax_history, torch.zeros_like(state.amax_history))
        assert state.scale.item() == 1.0


def test_sync_before_the_first_forward_seeds_only_the_weight() -> None:
    mod = _layer()
    before = {n: b.clone() for n, b in mod.named_buffers()}
    assert sync_float8_amax_and_scale_history(mod) == 3  # reduced; only the weight is seeded
    assert mod.delayed_scaling.weight_ready and not mod.delayed_scaling.ready
    weight = mod.delayed_scaling.view(Operand.WEIGHT)
    expected = amax_to_scale(mod.weight.detach().abs().amax().float(), E4M3)
    assert torch.equal(weight.scale, expected) and bool(weight.initialized)
    for name, buf in mod.named_buffers():
        if not name.endswith("_weight"):
            assert torch.equal(buf, before[name]), name
    seeded = {n: b.clone() for n, b in mod.named_buffers()}
    sync_float8_amax_and_scale_history(mod)  # idempotent: no forward since, nothing rolls
    for name, buf in mod.named_buffers():
        assert torch.equal(buf, seeded[name]), name
    _step(mod, torch.randn(2, 64))  # a normal step after it
    assert mod.delayed_scaling.ready and bool(mod.delayed_scaling.view(Operand.INPUT).initialized)


@pytest.mark.parametrize("fill", [1.0, float("nan"), 0.0], ids=["finite", "nan", "zero"])
def test_each_training_forward_marks_the_layer_as_run(fill: float) -> None:
    # the sync rolls a layer's history only where it ran: every training forward counts
    # on the device (through its input's record, whatever that amax is), no other forward
    layer = _layer()
    x = torch.full((4, 64), fill)
    with torch.no_grad():
        layer(x)
    layer.eval()
    layer(x)
    layer.train()
    assert layer.delayed_scaling.fp8_forwards.item() == 0
    layer(x)
    assert layer.delayed_scaling.fp8_forwards.item() == 1
    layer(x)
    assert layer.delayed_scaling.fp8_forwards.item() == 2
    weight_only = Float8Linear(
        64, 32, config=Float8LinearConfig(cast_config_weight=DELAYED)
    )  # no delayed input: counted apart from any record
    weight_only(x)
    assert weight_only.delayed_scaling.fp8_forwards.item() == 1
