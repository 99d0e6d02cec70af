"""Delayed scaling once synced: the host learns from the sync (a non-blocking read of the
`initialized` flags) that an operand's scale is synced, and from then on its cast takes
that scale as it is, so the cast no longer waits for its own tensor's amax (compiled for
a GPU the amax then joins the cast's kernel: one pass over the tensor). Numerics are the
same: before, the device chose the synced scale too."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd

from fsdp_float8 import (
    Float8Linear,
    Operand,
    convert_to_float8_training,
    float8_step,
    sync_float8_amax_and_scale_history,
)
from fsdp_float8.core.scaling import rows_then_tensor_amax, tensor_amax
from tests.unit.float8_helpers import make_config

CONFIG = make_config("tensorwise", "delayed")  # input, weight and grad_output delayed
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _layer() -> Float8Linear:
    torch.manual_seed(0)
    return Float8Linear.from_float(nn.Linear(64, 32, bias=False), CONFIG)


def _step(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    xi = x.clone().requires_grad_()
    out = layer(xi)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    return out.detach(), xi.grad, layer.weight.grad


def _casts_waiting_for_an_amax(gm: torch.fx.GraphModule) -> int:
    """Casts to float8 in `gm` that have an amax reduction among their inputs' ancestors."""
    waiting = 0
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if not (node.op == "call_function" and getattr(val, "dtype", None) in FLOAT8):
            continue
        seen, todo = set(), list(node.all_input_nodes)
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op == "call_function" and "amax" in str(n.target):
                waiting += 1
                break
            todo.extend(n.all_input_nodes)
    return waiting


def test_a_sync_makes_the_operands_ready_on_the_host():
    layer = _layer()
    state = layer.delayed_scaling
    assert state.ready_ops == frozenset()
    _step(layer, torch.randn(16, 64))
    assert state.ready_ops == frozenset()  # no sync yet: the casts scale by their own amax
    sync_float8_amax_and_scale_history(layer)
    assert state.ready_ops == {Operand.INPUT, Operand.WEIGHT, Operand.GRAD_OUTPUT}
    for op in state.operands:
        view = state.view(op)
        assert view.ready and torch.equal(view.inverse, view.scale.reciprocal())


def test_a_synced_cast_waits_for_no_amax_and_gives_the_same_numbers():
    eager, compiled_layer = _layer(), _layer()
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return gm

    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)
    compiled = torch.compile(compiled_layer, backend=backend, fullgraph=True)
    torch.manual_seed(1)
    xs = [torch.randn(16, 64) * (1 + i) for i in range(3)]
    for i, x in enumerate(xs):
        want, got = _step(eager, x), _step(compiled, x)
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b), i  # the same scales, eager or compiled, ready or not
        for layer in (eager, compiled_layer):
            sync_float8_amax_and_scale_history(layer)
            layer.zero_grad()
    # the first step's graphs (forward, backward), then once more when the operands became
    # ready after the first sync; the third step reuses them
    assert len(graphs) == 4, len(graphs)
    first_fwd, first_bwd, ready_fwd, ready_bwd = graphs
    # before: input and weight casts (forward), grad_output's (backward) wait for an amax
    assert _casts_waiting_for_an_amax(first_fwd) >= 2
    assert _casts_waiting_for_an_amax(first_bwd) >= 1
    assert _casts_waiting_for_an_amax(ready_fwd) == 0
    assert _casts_waiting_for_an_amax(ready_bwd) == 0
    # the GEMMs' inverse scales: made in the graph before, taken from the sync after
    assert _reciprocals(first_fwd) >= 2 and _reciprocals(first_bwd) >= 1
    assert _reciprocals(ready_fwd) == 0 and _reciprocals(ready_bwd) == 0


def _reciprocals(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if "reciprocal" in str(n.target))


def test_reset_and_loads_decide_ready_anew():
    layer = _layer()
    state = layer.delayed_scaling
    unsynced = {k: v.clone() for k, v in layer.state_dict().items()}
    _step(layer, torch.randn(16, 64))
    sync_float8_amax_and_scale_history(layer)
    assert state.ready_ops
    synced = {k: v.clone() for k, v in layer.state_dict().items()}
    # handing out the buffers drops `ready` (a write into them would run no hook)
    assert state.ready_ops == frozenset()
    sync_float8_amax_and_scale_history(layer)
    assert state.ready_ops
    layer.load_state_dict(unsynced)
    assert state.ready_ops == frozenset()
    layer.load_state_dict(synced)
    assert state.ready_ops == set(state.operands)
    for op in state.operands:  # not saved: remade from the loaded scale
        view = state.view(op)
        assert view.scale != 1 and torch.equal(view.inverse, view.scale.reciprocal())
    state.reset()
    assert state.ready_ops == frozenset()
    # a read queued before a reset (or a load) lands after it: dropped
    state.mark_ready([Operand.INPUT], [True], state.epoch - 1)
    assert state.ready_ops == frozenset()
    state.mark_ready([Operand.INPUT], [True], state.epoch)
    assert state.ready_ops == {Operand.INPUT}


@pytest.mark.parametrize(
    "shape", [(0, 4), (5,), (), (7, 3), (2, 3, 5), (1, 1)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_then_tensor_amax_is_the_tensor_amax(shape, dtype):
    torch.manual_seed(0)
    hp = (torch.randn(shape) * 100).to(dtype)
    assert torch.equal(rows_then_tensor_amax(hp), tensor_amax(hp))
    if hp.numel():
        hp.view(-1)[-1] = float("nan")
        assert rows_then_tensor_amax(hp).isnan() and tensor_amax(hp).isnan()


def test_a_scale_written_in_place_drops_ready_until_the_next_sync():
    # an in-place checkpoint load (dcp.load(model.state_dict()) writes the buffers, no load
    # hook runs) may bring an unsynced state: the float8 step's next refresh sees the
    # scale's version move, drops `ready` and makes the inverse anew from the scale
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32, bias=False))
    convert_to_float8_training(model, config=CONFIG)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    state = model[0].delayed_scaling

    def train_step():
        model(torch.randn(16, 64)).square().mean().backward()
        opt.step()  # the float8 step syncs after it
        opt.zero_grad()

    train_step()
    assert state.ready_ops == set(state.operands)
    with torch.no_grad():  # what an in-place load of a state saved before any sync writes
        state.fp8_scale_input.copy_(torch.tensor(2.0))
        state.fp8_initialized_input.fill_(False)
    model(torch.randn(16, 64))  # the refresh before this forward sees the write
    assert state.ready_ops == frozenset()
    assert state.fp8_inverse_input.item() == 0.5
    # not ready: the device flag decides again (unsynced: the input's own amax)
    view = state.view(Operand.INPUT)
    assert not view.ready and not view.initialized
    opt.zero_grad()
    train_step()
    assert state.ready_ops == set(state.operands)


def _trained_model(seed: int, scale: float) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 32, bias=False))
    convert_to_float8_training(model, config=CONFIG)
    opt = torch.optim.SGD(model.parameters(), lr=1e-1)
    for _ in range(3):
        model(torch.randn(16, 64) * scale).square().mean().backward()
        opt.step()  # the float8 step syncs after it
        opt.zero_grad()
    return model


@pytest.mark.parametrize("forward", ["no_grad", "eval", "step_disabled"])
def test_a_forward_without_a_refresh_after_a_scale_written_in_place_uses_it(forward):
    # an in-place load (dcp.load(model.state_dict()), an EMA update of the state dict's
    # tensors) followed by a forward that no refresh precedes: the cast and the GEMM's
    # inverse both come from the written scale, as after load_state_dict
    model, other = _trained_model(0, 1.0), _trained_model(1, 50.0)
    reference = copy.deepcopy(model)
    reference.load_state_dict(other.state_dict())
    with torch.no_grad():
        for mine, theirs in zip(model.state_dict().values(), other.state_dict().values()):
            mine.copy_(theirs)
    x = torch.randn(16, 64) * 10
    if forward == "no_grad":
        with torch.no_grad():
            got, want = model(x), reference(x)
    elif forward == "eval":
        model.eval(), reference.eval()
        got, want = model(x), reference(x)
    else:
        float8_step(model).disable(), float8_step(reference).disable()
        got, want = model(x), reference(x)
    assert torch.equal(got, want)


def test_a_deep_copy_knows_its_own_buffers():
    # copy.deepcopy (an EMA or teacher copy) gives new buffers with version counters of
    # their own: the copy's host flags are taken from them, so a later in-place write into
    # the copy is seen whatever its count
    model, other = _trained_model(0, 1.0), _trained_model(1, 50.0)
    ema = copy.deepcopy(model)
    state = ema[0].delayed_scaling
    assert state.ready_ops == set(state.operands) and state.weight_ready
    writes = max(state.scale_versions.values()) - min(
        state.view(op).scale._version for op in state.operands
    )
    for _ in range(max(writes, 1)):  # e.g. one EMA update of the state dict per step
        with torch.no_grad():
            for mine, theirs in zip(ema.state_dict().values(), other.state_dict().values()):
                mine.copy_(theirs)
    reference = copy.deepcopy(model)
    reference.load_state_dict(other.state_dict())
    x = torch.randn(16, 64) * 10
    with torch.no_grad():
        assert torch.equal(ema(x), reference(x))


@pytest.mark.parametrize("forward", ["no_grad", "eval"])
def test_a_compiled_forward_after_a_scale_written_in_place_uses_it(forward):
    # a compiled forward runs no host code before its graph, so the state dict that hands
    # out the buffers for such a write drops `ready` itself: the compiled cast then takes
    # the scale the device holds and makes its inverse in the graph, until the next sync
    model, other = _trained_model(0, 1.0), _trained_model(1, 50.0)
    reference = copy.deepcopy(model)
    reference.load_state_dict(other.state_dict())
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(16, 64) * 10
    if forward == "eval":
        model.eval(), reference.eval()
    with torch.no_grad():
        compiled(x)  # compiled while synced
        for mine, theirs in zip(model.state_dict().values(), other.state_dict().values()):
            mine.copy_(theirs)
        got, want = compiled(x), reference(x)
    assert torch.equal(got, want)
