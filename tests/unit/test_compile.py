"""torch.compile of float8: fullgraph, no graph breaks, and the same numbers as eager.

`aot_eager` (fast on CPU) runs in the default suite: it traces through dynamo and
AOTAutograd exactly as inductor would, so a graph break or an untraceable subclass fails
here. One inductor test (slow) checks that generated kernels give bitwise-equal scales.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo.testing
from torch import nn

from fsdp_float8 import (
    Float8Linear,
    Float8Tensor,
    NVFP4Config,
    convert_to_float8_training,
    hp_to_float8,
)
from fsdp_float8.core.config import E4M3
from fsdp_float8.core.scaling import amax_to_scale
from tests.unit.float8_helpers import RECIPES, SCALINGS, make_config


@pytest.fixture(autouse=True)
def _fresh_dynamo_caches():
    # each test compiles Float8Linear.forward for its own config: start from empty caches
    # so the DEFAULT recompile limit applies (raising it suite-wide would hide recompiles)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _run(module, x):
    y = module(x)
    y.float().square().sum().backward()
    return y.detach(), x.grad.detach().clone(), module.weight.grad.detach().clone()


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_linear_fullgraph_matches_eager(recipe, scaling):
    torch.manual_seed(0)
    eager = Float8Linear.from_float(nn.Linear(64, 48), make_config(recipe, scaling))
    compiled_mod = copy.deepcopy(eager)
    compiled = torch.compile(compiled_mod, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 8, 64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    for a, b in zip(_run(eager, x1), _run(compiled, x2), strict=True):
        assert torch.equal(a, b)
    for name, buf in eager.named_buffers():  # delayed amaxes recorded identically
        assert torch.equal(buf, dict(compiled_mod.named_buffers())[name]), name


def test_float8_tensor_as_graph_input_and_output():
    x = torch.randn(32, 16)
    scale = amax_to_scale(x.abs().amax(), E4M3)
    fp8 = hp_to_float8(x, scale, E4M3)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def reshape_and_transpose(t: Float8Tensor) -> Float8Tensor:
        return t.t().reshape(16, 32)

    out = reshape_and_transpose(fp8)
    assert isinstance(out, Float8Tensor)
    assert torch.equal(out.dequantize(), fp8.dequantize().t().reshape(16, 32))

    @torch.compile(backend="aot_eager", fullgraph=True)
    def make(t: torch.Tensor) -> Float8Tensor:
        return hp_to_float8(t, amax_to_scale(t.abs().amax(), E4M3), E4M3)

    made = make(x)
    assert isinstance(made, Float8Tensor)
    assert torch.equal(made._data.view(torch.uint8), fp8._data.view(torch.uint8))


@pytest.mark.slow
def test_inductor_scales_bitwise_equal_to_eager():
    torch.manual_seed(0)
    xs = [torch.randn(256, 512) * s for s in (1e-3, 1.0, 300.0)]

    def scales(t):
        return (
            amax_to_scale(t.abs().amax(), E4M3),
            amax_to_scale(t.abs().amax(dim=-1, keepdim=True), E4M3, power_of_2=True),
        )

    compiled = torch.compile(scales, backend="inductor", fullgraph=True)
    for x in xs:
        for a, b in zip(scales(x), compiled(x), strict=True):
            assert torch.equal(a, b)
    eager = Float8Linear.from_float(nn.Linear(64, 48), make_config("tensorwise", "dynamic"))
    comp = torch.compile(copy.deepcopy(eager), backend="inductor", fullgraph=True)
    x = torch.randn(4, 64)
    assert torch.equal(eager(x), comp(x))


def test_delayed_compiles_one_graph_for_any_number_of_micro_batches():
    """Delayed scaling counts training forwards on the device, so the compiled forward reads
    no host counter: gradient accumulation over 4 micro-batches and 3 optimizer steps
    compile one forward graph per layer, and one more once the first sync has made the
    layer's scales ready on the host (its casts then wait for no amax), under the default
    recompile limit."""
    assert torch._dynamo.config.cache_size_limit == 8  # the default: nothing raised it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32))
    convert_to_float8_training(model, config=make_config("tensorwise", "delayed"))
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    for layer in (model[0], model[2]):
        # the second layer's other shape makes dynamo recompile the shared forward code with
        # dynamic shapes: that graph serves every later shape too
        layer.compile(backend=counter, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    graphs = []
    for _step in range(3):
        for _micro_batch in range(4):
            model(torch.randn(2, 8, 64)).square().mean().backward()
            graphs.append(counter.frame_count)
        opt.step()
        opt.zero_grad()
    # the two layers differ in shapes: one graph each, compiled by the first forward; after
    # the first sync each recompiles once, ready; then nothing more
    assert graphs == [2] * 4 + [4] * 8, graphs
    assert model[0].delayed_scaling.syncs == 3  # after each optimizer step (one process: no seed)


# torch 2.11's Dynamo asserts (overwrite_tensor_vt_proxy) when NVFP4's autograd function,
# whose forward branches on its input's shape (the quantize and GEMM checks), is recompiled
# with dynamic shapes; torch 2.13+ traces it. README says: dynamic=False for NVFP4 there.
_DYNAMO_211 = torch.torch_version.TorchVersion(torch.__version__) < (2, 13)
_NVFP4_DYNAMIC = pytest.mark.xfail(
    _DYNAMO_211, reason="torch 2.11's Dynamo: NVFP4 dynamic-shape recompile", strict=True
)


@pytest.mark.parametrize(
    "kind", ["tensorwise", "rowwise", pytest.param("nvfp4", marks=_NVFP4_DYNAMIC)]
)
def test_layers_of_two_shapes_trace_a_dynamic_shape_recompile(kind):
    """Two layers of different shapes compiled with the default `dynamic=None`: dynamo
    recompiles the shared forward code with dynamic shapes, which must trace on every
    supported torch (no shape is kept on the autograd context) and give eager's numbers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48, bias=False), nn.ReLU(), nn.Linear(48, 32, bias=False))
    config = NVFP4Config(emulate=True) if kind == "nvfp4" else make_config(kind, "dynamic")
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: True)
    eager = copy.deepcopy(model)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    for layer in (model[0], model[2]):
        layer.compile(backend=counter, fullgraph=True)
    for tokens in (8, 24):
        x = torch.randn(2, tokens, 64)
        xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        yc, ye = model(xc), eager(xe)
        yc.float().square().sum().backward()
        ye.float().square().sum().backward()
        assert torch.equal(yc, ye) and torch.equal(xc.grad, xe.grad), tokens
    assert counter.frame_count >= 3  # a dynamic-shape recompile did happen


@pytest.mark.parametrize(
    "kind",
    [
        "tensorwise",
        "tensorwise:static",
        "rowwise_with_gw_hp:static",
        "rowwise",
        "mxfp8",
        pytest.param("nvfp4", marks=_NVFP4_DYNAMIC),
    ],
)
def test_a_model_compiled_with_dynamic_true_traces_and_matches_eager(kind):
    """`torch.compile(model, dynamic=True)`: two float8 layers in one graph, every shape
    symbolic from the first call. Both layers' casts trace (the scale math and the static
    scales read no float that Dynamo would make a graph input, which the second layer's
    autograd.Function cannot reach), and every batch size gives eager's output and
    gradients bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU(), nn.Linear(64, 64, bias=False))
    recipe, _, scaling = kind.partition(":")
    if recipe == "nvfp4":
        config = NVFP4Config(emulate=True)
    elif recipe == "mxfp8":
        config = make_config(recipe, "dynamic", emulate=True)
    else:
        config = make_config(recipe, scaling or "dynamic")
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: True)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager", dynamic=True, fullgraph=True)
    for batch in (4, 3):
        x = torch.randn(batch, 32, 64)
        xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        yc, ye = compiled(xc), eager(xe)
        yc.square().sum().backward()
        ye.square().sum().backward()
        assert torch.equal(yc, ye) and torch.equal(xc.grad, xe.grad), batch
        assert torch.equal(model[2].weight.grad, eager[2].weight.grad), batch
