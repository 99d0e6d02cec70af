"""The float8 casts of an input that several linears read (`fsdp_float8.core.input_casts`).

Three layers reading one activation (attention's wq, wk, wv) must give the same bits as
three layers reading three copies of it, forward and backward, with fewer amax passes over
the activation and fewer copies of its cast (counted with a dispatch mode): tensorwise
shares the forward cast and its column-major copy, rowwise the grad_weight cast. A write
into the input between two readers, another cast, activation checkpointing and inference
mode each make the reader cast for itself (input casts other than dynamic are refused at
config time: they would share nothing); the shared record
lives until the last reader's backward, not longer. Sharing is opt-in
(`share_input_casts=True`); by default each reader casts for itself, so writes that leave the
input's version counter alone (`.data`, numpy views, a refilled buffer) are seen.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_float8 import CastConfig, Float8Linear, Float8LinearConfig

M, K, N = 64, 96, 80
# sharing is opt-in; the tests of what it shares turn it on
TENSORWISE = Float8LinearConfig.from_recipe_name("tensorwise", share_input_casts=True)
DEFAULT = Float8LinearConfig.from_recipe_name("tensorwise")


class _AmaxPasses(TorchDispatchMode):
    """amax ops over tensors of x's size (M * K elements, the only tensors of that size),
    and copies of its float8 cast (grad_weight's column-major operand)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, first = func.overloadpacket.__name__, args[0]
        if name in ("amax", "max") and first.numel() == M * K:
            self.count += 1
        if name in ("clone", "copy_") and first.numel() == M * K and first.itemsize == 1:
            self.copies += 1
        return func(*args, **(kwargs or {}))


def _layers(*configs: Float8LinearConfig) -> nn.ModuleList:
    torch.manual_seed(0)
    layers = [Float8Linear(K, N, bias=False, config=c) for c in configs]
    return nn.ModuleList(layers).to(torch.bfloat16)


def _x(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=g) * 3).to(torch.bfloat16)


def _run(layers: nn.ModuleList, shared: bool) -> tuple[list, list, tuple[int, int]]:
    x = _x().requires_grad_()
    copies = [x if shared else x.clone() for _ in layers]
    with _AmaxPasses() as passes:
        outs = [layer(xi) for layer, xi in zip(layers, copies, strict=True)]
        sum(o.float().square().sum() for o in outs).backward()
    grads = [x.grad] + [layer.weight.grad for layer in layers]
    return outs, grads, (passes.count, passes.copies)


# (amax passes over x, copies of its float8 cast): three readers of one x, three of copies
_COUNTS = {
    # forward: one cast; backward: one column-major copy of it
    "tensorwise": ((1, 1), (3, 3)),
    # forward: each reader's own row cast; backward: one grad_weight cast along the tokens
    "rowwise": ((4, 0), (6, 0)),
}


@pytest.mark.parametrize("recipe", sorted(_COUNTS))
def test_readers_of_one_input_share_its_casts_bit_for_bit(recipe):
    config = Float8LinearConfig.from_recipe_name(recipe, share_input_casts=True)
    layers = _layers(config, config, config)
    outs, grads, passes = _run(layers, shared=True)
    for layer in layers:
        layer.weight.grad = None
    want_outs, want_grads, own_passes = _run(layers, shared=False)
    assert (passes, own_passes) == _COUNTS[recipe], (passes, own_passes)
    for got, want in zip(outs + grads, want_outs + want_grads, strict=True):
        assert torch.equal(got, want)


def test_a_write_into_the_input_between_readers_casts_anew():
    layers = _layers(TENSORWISE, TENSORWISE)
    x = _x()
    first = layers[0](x)  # its graph holds the record
    x.view(-1)[:K].mul_(64)  # through a view: the version counter is shared
    got = layers[1](x)
    want = layers[1](x.clone())
    assert first.requires_grad and torch.equal(got, want)


@pytest.mark.parametrize(
    "other",
    [
        {"cast_config_input": CastConfig(target_dtype=torch.float8_e5m2), "emulate": True},
        {"round_scales_to_power_of_2": True},
    ],
    ids=["e5m2_input", "power_of_2"],
)
def test_another_cast_casts_for_itself(other):
    config = Float8LinearConfig.from_recipe_name("tensorwise", share_input_casts=True, **other)
    layers = _layers(TENSORWISE, config)
    x = _x()
    with _AmaxPasses() as passes:
        first = layers[0](x)  # its graph holds the record
        got = layers[1](x)
    want = layers[1](x.clone())
    assert first.requires_grad and passes.count == 2 and torch.equal(got, want)


def _attention_like(x: torch.Tensor, layers: nn.ModuleList) -> torch.Tensor:
    return sum(layer(x).float().square().sum() for layer in layers)


def test_checkpointed_readers_cast_for_themselves_and_match():
    # activation checkpointing drops the forward's casts and replays them: no reader may
    # take a cast kept from the forward, in the forward or in the recompute
    from torch.utils.checkpoint import checkpoint

    layers = _layers(TENSORWISE, TENSORWISE, TENSORWISE)
    x = _x().requires_grad_()
    with _AmaxPasses() as passes:
        checkpoint(_attention_like, x, layers, use_reentrant=False).backward()
    got = [x.grad] + [layer.weight.grad for layer in layers]
    for layer in layers:
        layer.weight.grad = None
    x2 = _x().requires_grad_()
    _attention_like(x2, layers).backward()
    want = [x2.grad] + [layer.weight.grad for layer in layers]
    assert passes.count == 6, passes.count  # 3 in forward, 3 in the recompute
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_table_keeps_no_cast_alive():
    # only the readers' contexts hold a kept cast: without a graph it is gone at once
    from fsdp_float8.core.input_casts import _RECORDS

    layers = _layers(TENSORWISE, TENSORWISE)
    x = _x().requires_grad_()
    with torch.no_grad(), _AmaxPasses() as passes:
        layers[0](x), layers[1](x)
    assert passes.count == 2
    out = layers[0](x)
    assert _RECORDS[x]() is not None
    del out
    assert _RECORDS[x]() is None
    # the last reader's backward lets go, though the graph (and its contexts) stays
    loss = layers[0](x).float().sum() + layers[1](x).float().sum()
    assert _RECORDS[x]() is not None
    loss.backward()
    assert _RECORDS[x]() is None


def test_inference_mode_reads_cast_for_themselves():
    layers = _layers(TENSORWISE, TENSORWISE)
    with torch.inference_mode():
        x = _x()
        outs = [layer(x) for layer in layers]
        want = [layer(x.clone()) for layer in layers]
    assert all(torch.equal(a, b) for a, b in zip(outs, want, strict=True))


def _expert_run(config: Float8LinearConfig, shared: bool, same_offs: bool = True):
    """w1 and w3 of grouped experts on one token tensor (or a copy each): outputs and
    gradients, and how many grad_weight casts of the tokens backward made."""
    import fsdp_float8.experts.gemm as expert_gemm
    from fsdp_float8.core.gemms import Gemm, Operand
    from fsdp_float8.experts.gemm import ExpertCastPlan, float8_grouped_mm

    plan = ExpertCastPlan.from_config(config)
    g = torch.Generator().manual_seed(0)
    w1, w3 = (torch.randn(4, 48, K, generator=g).requires_grad_() for _ in range(2))
    x = (torch.randn(M, K, generator=g) * 3).requires_grad_()
    offs = torch.tensor([8, 8, 40, M], dtype=torch.int32)
    offs3 = offs if same_offs else offs.clone()
    x1, x3 = (x, x) if shared else (x.clone(), x.clone())
    casts = []
    own = expert_gemm.cast_expert_operand

    def counted(hp, op, gemm, plan, offs):
        if (op, gemm) == (Operand.INPUT, Gemm.GRAD_WEIGHT):
            casts.append(hp)
        return own(hp, op, gemm, plan, offs)

    expert_gemm.cast_expert_operand = counted
    try:
        out = float8_grouped_mm(x1, w1, offs, plan) * float8_grouped_mm(x3, w3, offs3, plan)
        out.square().sum().backward()
    finally:
        expert_gemm.cast_expert_operand = own
    return [out, x.grad, w1.grad, w3.grad], len(casts)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_expert_projections_of_one_input_share_its_grad_weight_cast(recipe):
    config = Float8LinearConfig.from_recipe_name(recipe, emulate=True, share_input_casts=True)
    got, shared_casts = _expert_run(config, shared=True)
    want, own_casts = _expert_run(config, shared=False)
    _, other_offs_casts = _expert_run(config, shared=True, same_offs=False)
    assert (shared_casts, own_casts, other_offs_casts) == (1, 2, 2)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


# -- the default: no sharing, so no write can leave a reader a stale cast ------------------


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_readers_cast_for_themselves_by_default(recipe):
    config = Float8LinearConfig.from_recipe_name(recipe)
    layers = _layers(config, config, config)
    _, _, passes = _run(layers, shared=True)
    own = _COUNTS[recipe][1]  # three readers of three copies
    assert passes == own, (passes, own)


def _data_mul(x: torch.Tensor) -> None:
    x.data.mul_(2)


def _data_assign(x: torch.Tensor) -> None:
    x.data = _x(seed=5).float()


def _numpy_mul(x: torch.Tensor) -> None:
    x.numpy()[:] *= 2


def _from_numpy_mul(x: torch.Tensor) -> None:
    torch.from_numpy(x.numpy()).mul_(2)


@pytest.mark.parametrize(
    "write",
    [_data_mul, _data_assign, _numpy_mul, _from_numpy_mul],
    ids=["data.mul_", "data=", "numpy", "from_numpy"],
)
def test_writes_that_keep_the_version_counter_are_seen_by_default(write):
    # writes below the version counter: each reader casts what it reads (float32: numpy)
    torch.manual_seed(0)
    layers = nn.ModuleList(Float8Linear(K, N, bias=False, config=DEFAULT) for _ in range(2))
    x = _x().float()
    first = layers[0](x)
    write(x)
    got = layers[1](x)
    want = layers[1](x.clone())
    assert first.requires_grad and torch.equal(got, want)


class _Attention(nn.Module):
    """q, k, v projections of a static input buffer the caller refills."""

    def __init__(self, config: Float8LinearConfig) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.ModuleList(Float8Linear(K, N, bias=False, config=config) for _ in range(3))
        self.register_buffer("buf", torch.zeros(M, K))

    def forward(self) -> torch.Tensor:
        q, k, v = (proj(self.buf) for proj in self.qkv)
        return (torch.softmax(q @ k.t() / N**0.5, -1) @ v).square().sum()


def _micro_batch_losses(config: Float8LinearConfig, refill) -> list[torch.Tensor]:
    # the losses of two micro-batches, summed before one backward: micro-batch 1's graph
    # (and its readers' contexts) is alive during micro-batch 2's forward
    block = _Attention(config)
    losses = []
    for seed in (1, 2):
        refill(block.buf, _x(seed).float())
        losses.append(block())
    return losses


def test_a_refilled_input_buffer_is_cast_anew_each_micro_batch():
    def data_copy(buf, x):
        buf.data.copy_(x)

    def fresh(buf, x):  # a write the version counter sees
        buf.copy_(x)

    got = _micro_batch_losses(DEFAULT, data_copy)
    want = _micro_batch_losses(DEFAULT, fresh)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (got, want)
