"""A precomputed weight scale is trusted only while the weight's values are unchanged.

Every in-place path a user or an optimizer takes must make `has_fresh_precomputed_scale()`
False, and the scale the next all-gather would use (`float8_scale`) must then equal a scale
freshly computed from the current weight. Ops that only alias the weight (views, detach,
`.data`) share its mutation state; copies with the same values (clone) keep a fresh scale.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_float8 import (
    DynamicFloat8Weight,
    Float8LinearConfig,
    convert_to_float8_training,
    float8_step,
    precompute_float8_dynamic_scale_for_fsdp,
)
from fsdp_float8.core.config import E4M3
from fsdp_float8.core.scaling import amax_to_scale, tensor_amax

CONFIG = Float8LinearConfig.tensorwise(enable_fsdp_float8_all_gather=True)


def _model(*, step: bool = False) -> nn.Module:
    """The float8 step off by default: these tests watch the mutation tracking itself
    (with it on, an optimizer step refreshes the scale at once)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32, bias=False))
    model = convert_to_float8_training(model, config=CONFIG)
    if not step:
        float8_step(model).disable()
    return model


def _weight(model: nn.Module) -> DynamicFloat8Weight:
    w = model[0].weight
    assert isinstance(w, DynamicFloat8Weight)
    return w


def _step(optimizer_cls, **kwargs):
    def mutate(model):
        opt = optimizer_cls(model.parameters(), **kwargs)
        model(torch.randn(4, 32)).float().pow(2).sum().backward()
        opt.step()

    return mutate


@torch.no_grad()
def _load_scaled(model):
    sd = {k: v * 1000 for k, v in model.state_dict().items()}
    model.load_state_dict(sd)


@torch.no_grad()
def _mul(model):
    model[0].weight.mul_(1000)


@torch.no_grad()
def _copy(model):
    model[0].weight.copy_(torch.randn(32, 32) * 1000)


MUTATIONS = {
    "mul_": _mul,
    "copy_": _copy,
    "data.mul_": lambda m: m[0].weight.data.mul_(1000),
    "detach.add_": lambda m: m[0].weight.detach().add_(1000),
    "adamw_foreach": _step(torch.optim.AdamW, lr=1.0, foreach=True),
    "adamw_for_loop": _step(torch.optim.AdamW, lr=1.0, foreach=False),
    "sgd": _step(torch.optim.SGD, lr=1000.0),
    "load_state_dict": _load_scaled,
    # writes through views that are not the weight's own aliases
    "t.mul_": lambda m: m[0].weight.detach().t().mul_(1000),
    "T.mul_": lambda m: m[0].weight.data.T.mul_(1000),
    "select.mul_": lambda m: m[0].weight.detach()[0].mul_(1000),
    "setitem": lambda m: m[0].weight.data.__setitem__(0, 1000.0),
    "permute.mul_": lambda m: m[0].weight.detach().permute(1, 0).mul_(1000),
    "diagonal.mul_": lambda m: m[0].weight.detach().diagonal().mul_(1000),
    "unsqueeze.mul_": lambda m: m[0].weight.detach().unsqueeze(0).mul_(1000),
}


@pytest.mark.parametrize("path", sorted(MUTATIONS))
def test_mutation_invalidates_precomputed_scale(path):
    model = _model()
    assert precompute_float8_dynamic_scale_for_fsdp(model) == 1
    assert _weight(model).has_fresh_precomputed_scale()
    MUTATIONS[path](model)
    w = _weight(model)
    assert not w.has_fresh_precomputed_scale(), path
    fresh = amax_to_scale(tensor_amax(w._tensor), E4M3)
    assert torch.equal(w.float8_scale(None), fresh), path


@pytest.mark.parametrize("path", ["adamw_foreach", "adamw_for_loop", "sgd"])
def test_the_float8_step_refreshes_after_an_optimizer_step(path):
    model = _model(step=True)
    MUTATIONS[path](model)
    w = _weight(model)
    assert w.has_fresh_precomputed_scale(), path
    fresh = amax_to_scale(tensor_amax(w._tensor), E4M3)
    assert torch.equal(w.float8_scale(None), fresh), path


def test_aliases_share_state_and_same_value_copies_stay_fresh():
    model = _model()
    precompute_float8_dynamic_scale_for_fsdp(model)
    w = _weight(model)
    view = w.view(-1)
    assert view.has_fresh_precomputed_scale()  # a view sees the same values
    clone = w.clone()
    assert clone.has_fresh_precomputed_scale()  # same values, own storage
    with torch.no_grad():
        view.mul_(1000)  # writes through the alias
    assert not w.has_fresh_precomputed_scale()
    assert clone.has_fresh_precomputed_scale()  # its own storage did not change
    with torch.no_grad():
        clone.add_(1)
    assert not clone.has_fresh_precomputed_scale()


def test_direct_write_to_the_inner_tensor_is_seen():
    # e.g. a checkpoint loader writing into the plain tensors of a state_dict
    model = _model()
    precompute_float8_dynamic_scale_for_fsdp(model)
    sd = model.state_dict()
    with torch.no_grad():
        sd["0.weight"].mul_(1000)
    assert not _weight(model).has_fresh_precomputed_scale()


def test_meta_init_precompute_to_empty_and_load():
    real = _model()
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 32, bias=False))
    convert_to_float8_training(model, config=CONFIG)
    precompute_float8_dynamic_scale_for_fsdp(model)  # a scale of meta values
    model.to_empty(device="cpu")
    model.load_state_dict(real.state_dict())
    w = _weight(model)
    assert not w.has_fresh_precomputed_scale()
    fresh = amax_to_scale(tensor_amax(real[0].weight._tensor), E4M3)
    assert torch.equal(w.float8_scale(None), fresh)


def test_aliases_made_per_forward_do_not_pile_up():
    model = _model()
    for _ in range(20):
        model(torch.randn(2, 32)).sum().backward()  # each cast takes a detached alias
    assert len(_weight(model)._state._inners) <= 3


def test_a_kept_pack_is_answered_only_while_values_key_and_stamp_stand():
    """`WeightState.packed_for`, which the all-gather hook asks first: the pack kept under
    a key comes back for the same key (objects by identity, plain values by value) and is
    refused after a write into the values, a new stamp, or a write into the stamp."""
    from fsdp_float8.weight_wrappers.state import WeightState

    inner, mesh = torch.randn(4, 4), object()
    key = (mesh, (8, 4), torch.Size([4, 4]))

    def kept(mutate) -> object:
        state = WeightState()
        state.register(inner)
        pair = torch.tensor([2.0, 0.5])
        state.stamp_scale(pair[0], pair)
        state.remember_pack(key, "pack")
        mutate(state, pair)
        return state.packed_for(key)

    assert kept(lambda s, p: None) == "pack"
    same_values = (mesh, (8, 4), (4, 4))
    state = WeightState()
    state.remember_pack(key, "pack")
    assert state.packed_for(same_values) == "pack"
    assert state.packed_for((object(), (8, 4), (4, 4))) is None  # another mesh
    assert state.packed_for((mesh, (9, 4), (4, 4))) is None  # another outer size
    assert kept(lambda s, p: s.bump()) is None  # an in-place op through a wrapper
    assert kept(lambda s, p: inner.add_(0)) is None  # a direct write into the inner tensor
    assert kept(lambda s, p: s.stamp_scale(torch.tensor(3.0))) is None  # a new stamp
    assert kept(lambda s, p: p.mul_(1)) is None  # a write into the stamp
