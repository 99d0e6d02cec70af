"""The float8 step's public switch, and the usages that broke it (single process).

- `float8_step(model)` / `Float8Step`: on for any tree of float8 layers (converted here or
  built elsewhere), off by `disable()`, `describe()` says what it does;
- `torch.compile(model, fullgraph=True)` of a converted model, every recipe, with and
  without the float8 all-gather config: no graph break, eager == compiled over 2 training
  steps (the step refreshes between them);
- an optimizer built before conversion holds replaced Parameters: its first step raises,
  naming the parameter and the remedy;
- `data_ptr()` of a weight wrapper is its inner tensor's.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

from fsdp_float8 import (
    Float8Linear,
    Float8LinearConfig,
    Float8Step,
    convert_to_float8_training,
    float8_step,
)
from tests.unit.float8_helpers import make_config

COMPILE_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8")


@pytest.fixture(autouse=True)
def _fresh_dynamo_caches():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _mlp(config: Float8LinearConfig, dim: int = 128) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
    return convert_to_float8_training(model, config=config)


def _train(model: nn.Module, forward, steps: int = 2) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outs = []
    for step in range(steps):
        x = torch.randn(16, 128, generator=torch.Generator().manual_seed(step))
        out = forward(x)
        out.float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        outs.append(out.detach())
    return outs + [p.detach() for p in model.parameters()]


def _eager_and_compiled(config: Float8LinearConfig, backend: str) -> None:
    eager = _mlp(config)
    compiled = copy.deepcopy(eager)  # a deep copy gets a float8 step of its own
    fn = torch.compile(compiled, backend=backend, fullgraph=True)
    if backend == "aot_eager":  # the same ops: bit for bit, outputs and trained weights
        for a, b in zip(_train(eager, eager), _train(compiled, fn), strict=True):
            assert torch.equal(a, b)
        return
    # inductor fuses (GELU, bias): its first output differs from eager by float32 rounding
    # (measured 1.8e-7 on values up to 0.62, ~3e-7 relative); bound 1e-5 relative. Later
    # steps are not compared: one element rounding to another float8 value diverges them.
    a, b = _train(eager, eager, steps=1)[0], _train(compiled, fn, steps=1)[0]
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


# the float8 all-gather config changes the weight (a wrapper) in every recipe; both configs
# for the recipes the float8 step refreshes, the other plain configs in the slow set
CONFIGS = [(r, True) for r in [*COMPILE_RECIPES, "delayed"]] + [
    ("tensorwise", False),
    ("delayed", False),
    *[pytest.param(r, False, marks=pytest.mark.slow) for r in COMPILE_RECIPES[1:]],
]


@pytest.mark.parametrize(("recipe", "all_gather"), CONFIGS)
def test_whole_model_fullgraph_compile_equals_eager(recipe, all_gather):
    if recipe == "delayed":
        config = make_config("tensorwise", "delayed", enable_fsdp_float8_all_gather=all_gather)
    else:
        config = Float8LinearConfig.from_recipe_name(
            recipe, enable_fsdp_float8_all_gather=all_gather
        )
    _eager_and_compiled(config, "aot_eager")


@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("delayed", marks=pytest.mark.slow)])
def test_whole_model_fullgraph_inductor_equals_eager(recipe):
    if recipe == "delayed":
        config = make_config("tensorwise", "delayed", enable_fsdp_float8_all_gather=True)
    else:
        config = Float8LinearConfig.tensorwise(enable_fsdp_float8_all_gather=True)
    _eager_and_compiled(config, "inductor")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_whole_model_fullgraph_inductor_equals_eager_slow(recipe):
    config = Float8LinearConfig.from_recipe_name(recipe, enable_fsdp_float8_all_gather=True)
    _eager_and_compiled(config, "inductor")


def test_switch_and_describe():
    config = Float8LinearConfig.tensorwise(enable_fsdp_float8_all_gather=True)
    model = _mlp(config)
    step = float8_step(model)
    assert isinstance(step, Float8Step) and step is float8_step(model)  # idempotent
    assert step.enabled
    plan = step.describe()
    assert plan.float8_layers == ("0", "2")
    assert plan.precomputed_weights == ("0.weight", "2.weight")
    assert plan.delayed_layers == ()
    assert plan.collectives_per_step == 0  # a single process: nothing to reduce across ranks
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    w = model[0].weight

    def one_step():
        model(torch.randn(4, 128)).square().sum().backward()
        opt.step()
        opt.zero_grad()

    step.disable()
    one_step()
    assert not step.enabled and not w.has_fresh_precomputed_scale()
    step.enable()
    one_step()
    assert w.has_fresh_precomputed_scale()


def test_float8_layers_built_elsewhere_get_the_step():
    # as torchtitan builds them from configs: no convert_to_float8_training call
    config = Float8LinearConfig.tensorwise(enable_fsdp_float8_all_gather=True)
    model = nn.Sequential(Float8Linear(64, 64, config=config), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    assert not model[0].weight.has_fresh_precomputed_scale()  # no step: nothing refreshed
    float8_step(model)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    assert model[0].weight.has_fresh_precomputed_scale()


def test_float8_step_of_a_model_without_float8_layers_is_refused():
    with pytest.raises(ValueError, match="holds no Float8Linear"):
        float8_step(nn.Sequential(nn.Linear(16, 16)))


def test_optimizer_built_before_conversion_is_refused_at_its_first_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # accelerate's FP8 order
    config = Float8LinearConfig.tensorwise(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config)
    model(torch.randn(2, 64)).sum().backward()
    with pytest.raises(ValueError, match=r"'0\.weight'.*Convert the model before building"):
        opt.step()
    assert all(p.grad is not None for p in model.parameters())  # nothing was stepped
    # built after conversion: trains every layer
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_optimizer_built_before_conversion_without_all_gather_is_fine():
    # without float8 all-gather the Parameters are shared, not replaced: the optimizer
    # built before conversion steps the converted layer's weight
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    convert_to_float8_training(model, config=Float8LinearConfig.tensorwise())
    model(torch.randn(2, 64)).sum().backward()
    weight = model[0].weight
    expected = weight.detach() - weight.grad  # SGD at lr 1: w - g, exactly
    assert weight.grad.abs().max() > 0
    opt.step()
    assert torch.equal(weight.detach(), expected)
    assert model[0].weight is weight


def test_weight_wrapper_data_ptr_is_the_inner_tensors():
    config = Float8LinearConfig.tensorwise(enable_fsdp_float8_all_gather=True)
    model = _mlp(replace(config))
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert 0 not in ptrs and len(set(ptrs)) == len(ptrs), ptrs
    assert model[0].weight.data_ptr() == model[0].weight._tensor.data_ptr()


def test_a_deepcopy_in_one_thread_leaves_data_ptr_alone_in_another():
    """Ranks of torch's threaded test process group share a process: one rank deep-copying
    its model must not make another rank's weights report data_ptr() 0."""
    import copy
    import threading

    config = Float8LinearConfig.tensorwise(enable_fsdp_float8_all_gather=True)
    copied, other = _mlp(replace(config)), _mlp(replace(config))
    inside, done = threading.Event(), threading.Event()
    original = torch.Tensor.__deepcopy__

    def slow_deepcopy(self, memo):
        inside.set()
        done.wait(10)
        return original(self, memo)

    seen = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "__deepcopy__", slow_deepcopy)
        thread = threading.Thread(target=copy.deepcopy, args=(copied[0].weight,))
        thread.start()
        assert inside.wait(10)
        seen = [p.data_ptr() for p in other.parameters()]
        done.set()
        thread.join(10)
    assert 0 not in seen, seen
