"""What the float8 all-gather and the float8 step do per step, counted (single process):

- a weight wrapper holds its cast resolved once (`WeightCast`): an all-gather hook asks the
  config nothing (counted: calls of `Float8LinearConfig.strategy` / `cast` /
  `float8_dtype` while the hooks run: 0, every scaling kind);
- a refresh computes the scales of all its weights in one vector op (counted: `clamp`
  ops, the EPS floor of the scale path, under a dispatch mode: 1 for 4 weights);
- the float8 step caches the model's structure: a steady training step (forward,
  backward, `optimizer.step()`) walks the module tree 0 times (counted: calls of
  `nn.Module.named_modules`, which `parameters()` and `modules()` go through too); a
  structural change (a module or parameter replaced) rebuilds it once.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_float8 import (
    Float8Linear,
    Float8LinearConfig,
    convert_to_float8_training,
    float8_step,
    precompute_float8_dynamic_scale_for_fsdp,
)
from tests.unit.float8_helpers import make_config


class _OneShard:
    def size(self) -> int:
        return 1


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


CONFIGS = {
    "dynamic": lambda: make_config("tensorwise", "dynamic", enable_fsdp_float8_all_gather=True),
    "delayed": lambda: make_config("tensorwise", "delayed", enable_fsdp_float8_all_gather=True),
    "static": lambda: make_config("tensorwise", "static", enable_fsdp_float8_all_gather=True),
    "rowwise": lambda: Float8LinearConfig.from_recipe_name(
        "rowwise", enable_fsdp_float8_all_gather=True
    ),
    "mxfp8": lambda: Float8LinearConfig.from_recipe_name(
        "mxfp8", enable_fsdp_float8_all_gather=True
    ),
}


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_an_all_gather_asks_the_config_nothing(kind, monkeypatch):
    layer = Float8Linear(64, 64, config=CONFIGS[kind]())
    w = layer.weight
    calls: Counter[str] = Counter()
    for name in ("strategy", "cast", "float8_dtype"):
        original = getattr(Float8LinearConfig, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Float8LinearConfig, name, counted)
    for out in (None, "refill"):
        inputs, meta = w.fsdp_pre_all_gather(_OneShard(), w.shape, w.stride(), layer, None)
        if out is None:
            unsharded, _ = w.fsdp_post_all_gather(inputs, meta, torch.float32)
            gathered = inputs  # FSDP2 refills the same output buffers in place
        else:
            for buffer, new in zip(gathered, inputs, strict=True):
                buffer.copy_(new)
            w.fsdp_post_all_gather(gathered, meta, torch.float32, out=unsharded)
    assert calls == Counter(), calls


def test_a_refresh_computes_all_scales_in_one_vector_op():
    config = Float8LinearConfig.from_recipe_name("tensorwise", enable_fsdp_float8_all_gather=True)
    model = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(4)])
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, n: True)
    with _OpCounter() as counter:
        assert precompute_float8_dynamic_scale_for_fsdp(model) == 4
    assert counter.ops["clamp"] == 1, counter.ops


def _training_steps(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_steady_step_walks_the_module_tree_zero_times(recipe, monkeypatch):
    config = Float8LinearConfig.from_recipe_name(recipe, enable_fsdp_float8_all_gather=True)
    model = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(3)])
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, n: True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _training_steps(model, opt, 1)  # the first step builds the structure
    walks = [0]
    original = nn.Module.named_modules

    def counted(self, *args, **kwargs):
        walks[0] += self is model  # a walk of the model (it recurses into the children)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "named_modules", counted)
    _training_steps(model, opt, 2)
    assert walks[0] == 0
    # a module replaced: the structure is rebuilt (the new layer's weight is refreshed)
    model[1] = nn.Sequential(nn.Linear(32, 32, bias=False))
    convert_to_float8_training(model[1], config=config, module_filter_fn=lambda m, n: True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    walks[0] = 0
    _training_steps(model, opt, 2)
    # one rebuild: the step's units, its parameters, the default mesh (3 walks)
    assert 0 < walks[0] <= 3, walks
    step_units = [u.fqn for u, _ in float8_step(model)._units()]
    assert "1.0.weight" in step_units, step_units
