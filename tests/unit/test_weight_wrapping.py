"""A layer configured for float8 all-gather holds a weight wrapper, whatever built it.

`Float8Linear(...)`, `Float8Linear.from_float` and `convert_to_float8_training` all wrap the
weight; `load_state_dict(..., assign=True)` keeps it wrapped; a layer whose weight lost its
wrapper anyway refuses to run (FSDP2 would silently gather it in high precision). A saved
wrapper parameter loads with `torch.load(weights_only=True)` after `import fsdp_float8`.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import fsdp_float8  # noqa: F401  (registers the safe globals)
from fsdp_float8 import (
    DelayedFloat8Weight,
    DynamicFloat8Weight,
    Float8Linear,
    Float8LinearConfig,
    StaticFloat8Weight,
)
from tests.unit.float8_helpers import make_config

AG = Float8LinearConfig.tensorwise(enable_fsdp_float8_all_gather=True)
WRAPPER = {"dynamic": DynamicFloat8Weight, "delayed": DelayedFloat8Weight}
WRAPPER["static"] = StaticFloat8Weight


@pytest.mark.parametrize("scaling", sorted(WRAPPER))
def test_from_float_wraps_and_shares_the_weight(scaling):
    config = make_config("tensorwise", scaling, enable_fsdp_float8_all_gather=True)
    linear = nn.Linear(32, 16)
    new = Float8Linear.from_float(linear, config)
    assert type(new.weight) is WRAPPER[scaling]
    assert new.weight._tensor.data_ptr() == linear.weight.data_ptr()  # shared, not copied
    assert type(Float8Linear(32, 16, config=config).weight) is WRAPPER[scaling]


def test_no_wrapper_without_float8_all_gather():
    new = Float8Linear.from_float(nn.Linear(32, 16), Float8LinearConfig.tensorwise())
    assert type(new.weight) is nn.Parameter


def test_load_state_dict_assign_keeps_the_wrapper():
    layer = Float8Linear(32, 16, config=AG)
    sd = {k: torch.randn_like(v) for k, v in Float8Linear(32, 16).state_dict().items()}
    layer.load_state_dict(sd, assign=True)
    assert isinstance(layer.weight, DynamicFloat8Weight) and layer.weight.requires_grad
    assert torch.equal(layer.weight._tensor, sd["weight"])
    layer(torch.randn(4, 32)).sum().backward()
    assert layer.weight.grad is not None


def test_a_layer_that_lost_its_wrapper_refuses_to_run():
    layer = Float8Linear(32, 16, config=AG)
    layer.weight = nn.Parameter(torch.randn(16, 32))
    with pytest.raises(TypeError, match="enable_fsdp_float8_all_gather"):
        layer(torch.randn(4, 32))


@pytest.mark.parametrize("scaling", sorted(WRAPPER))
def test_wrapper_parameter_loads_with_weights_only(scaling):
    recipe = "rowwise" if scaling == "dynamic" else "tensorwise"
    config = make_config(recipe, scaling, enable_fsdp_float8_all_gather=True)
    weight = Float8Linear(32, 16, config=config).weight
    buf = io.BytesIO()
    torch.save({"weight": weight}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["weight"]
    assert type(loaded) is type(weight) and loaded._config == config
    assert isinstance(loaded, nn.Parameter) and loaded.requires_grad
    assert torch.equal(loaded._tensor, weight._tensor)


class _OneShard:
    def size(self) -> int:
        return 1


def _gather_twice(w):
    """The unsharded weight after FSDP2's first all-gather and one refill (`out=`), the
    hooks called as FSDP2 calls them at shard size 1."""
    (gathered,), meta = w.fsdp_pre_all_gather(_OneShard(), w.shape, w.stride(), None, None)
    unsharded, _ = w.fsdp_post_all_gather((gathered,), meta, torch.float32)
    (payload,), meta = w.fsdp_pre_all_gather(_OneShard(), w.shape, w.stride(), None, None)
    gathered.copy_(payload)  # FSDP2 refills the same output buffer in place
    assert w.fsdp_post_all_gather((gathered,), meta, torch.float32, out=unsharded) is None
    return unsharded


@pytest.mark.parametrize("scaling", ["static", "dynamic"])
def test_a_refill_does_not_alias_a_shared_scale(scaling):
    # static: every layer's weight scale is one process-wide cached tensor; dynamic: the
    # precomputed scale stamped into the wrapper. A write into the unsharded weight's scale
    # (an in-place op on the gathered Float8Tensor) must reach neither.
    config = make_config("tensorwise", scaling, enable_fsdp_float8_all_gather=True)
    weights = [Float8Linear(32, 32, config=config).weight for _ in range(2)]
    if scaling == "dynamic":
        for w in weights:
            w.set_precomputed_scale(torch.tensor(2.0))
    sources = [w.float8_scale(None) for w in weights]
    before = [s.clone() for s in sources]
    unsharded = [_gather_twice(w) for w in weights]
    kept = unsharded[1]._scale.clone()
    scale_before = unsharded[0]._scale
    unsharded[0]._scale.copy_(torch.tensor(123.0))
    assert torch.equal(unsharded[1]._scale, kept)
    assert all(torch.equal(s, b) for s, b in zip(sources, before, strict=True)), sources
    # the refill is in place: the scale the first all-gather made is the one refilled
    assert unsharded[0]._scale is scale_before
