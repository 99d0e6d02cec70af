"""NVFP4 is a member of the weight-wrapper and layer architecture, not an impersonator.

Its FSDP2 weight is a `RefreshedWeight` (what the float8 step refreshes: a weight whose
stamp comes from the whole weight's amax), not a `DynamicFloat8Weight`; its cast has no
float8 scaling strategy and says so when asked; `wrap_weight` builds it, as it builds every
float8 weight; and both quantized linears share `QuantizedLinear` without overriding
`nn.Module.__setattr__`. The refresh stamps each class's own stamp: a float8 scale with its
inverse, or the 4-bit weight's amax.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_float8 import DynamicFloat8Weight, Float8Linear, Float8LinearConfig
from fsdp_float8.core.scaling import scale_from_amax
from fsdp_float8.fsdp.refresh import _stamp_scales, units_of
from fsdp_float8.nn.layer import QuantizedLinear
from fsdp_float8.nn.nvfp4_linear import NVFP4Config, NVFP4Linear
from fsdp_float8.weight_wrappers.cast import WeightCast
from fsdp_float8.weight_wrappers.nvfp4 import NVFP4FSDPWeight
from fsdp_float8.weight_wrappers.refreshed import RefreshedWeight
from fsdp_float8.weight_wrappers.wrap import replaced_parameter, wrap_weight, wrapper_class_of

NVFP4_AG = NVFP4Config(enable_fsdp_float8_all_gather=True)
FLOAT8_AG = Float8LinearConfig.tensorwise(enable_fsdp_float8_all_gather=True)


def test_the_nvfp4_weight_is_a_refreshed_weight_not_a_float8_one():
    assert issubclass(NVFP4FSDPWeight, RefreshedWeight)
    assert issubclass(DynamicFloat8Weight, RefreshedWeight)
    assert not issubclass(NVFP4FSDPWeight, DynamicFloat8Weight)
    w = NVFP4Linear(32, 32, config=NVFP4_AG).weight
    assert type(w) is NVFP4FSDPWeight and w.needs_global_amax and not w.per_row
    assert w.weight_cast.strategy is None
    with pytest.raises(TypeError, match="no float8 scaling strategy.*nvfp4"):
        w.strategy  # noqa: B018  (the float8 readers refuse, naming the format)


def test_wrap_weight_builds_every_layers_wrapper():
    for layer, wrapper in ((NVFP4Linear(32, 32), NVFP4FSDPWeight), (Float8Linear(32, 32), None)):
        config = NVFP4_AG if isinstance(layer, NVFP4Linear) else FLOAT8_AG
        assert wrapper_class_of(config) is (wrapper or DynamicFloat8Weight)
        layer.config = config
        old = layer.weight
        new = wrap_weight(old, layer)
        assert type(new.data) is (wrapper or DynamicFloat8Weight)
        assert new.data._tensor.data_ptr() == old.data_ptr()  # shared, not copied
        assert replaced_parameter(old) == f"weight (32, 32) of a {type(layer).__name__}"
    # from_float shares the float layer's weight and remembers it as replaced
    linear = nn.Linear(32, 32)
    new = NVFP4Linear.from_float(linear, NVFP4_AG)
    assert type(new.weight) is NVFP4FSDPWeight
    assert new.weight._tensor.data_ptr() == linear.weight.data_ptr()
    assert replaced_parameter(linear.weight) == "weight (32, 32) of a NVFP4Linear"


def test_configs_that_name_no_wrapper_are_refused():
    class Other:
        enable_fsdp_float8_all_gather = True
        emulate = False

    with pytest.raises(TypeError, match="Other.*weight_wrapper"):
        wrapper_class_of(Other())
    with pytest.raises(TypeError, match="Float8LinearConfig, got NVFP4Config"):
        WeightCast.of(NVFP4_AG)


@pytest.mark.parametrize("cls", [Float8Linear, NVFP4Linear])
def test_both_layers_share_the_base_and_keep_module_setattr(cls):
    assert issubclass(cls, QuantizedLinear)
    assert cls.__setattr__ is nn.Module.__setattr__  # FSDP2's structure cache relies on it
    for name in ("from_float", "wrap_weight_for_fsdp"):
        assert getattr(cls, name).__qualname__.startswith("QuantizedLinear."), name
    assert cls.float8_weight_names == ("weight",)
    with pytest.raises(TypeError, match="from_float expects an nn.Linear, got Conv1d"):
        cls.from_float(nn.Conv1d(32, 32, 1))


def test_the_refresh_finds_and_stamps_both_classes():
    torch.manual_seed(0)
    model = nn.Sequential(
        Float8Linear(32, 32, config=FLOAT8_AG), NVFP4Linear(32, 32, config=NVFP4_AG)
    )
    units = units_of(model)
    weights: list[tuple[int, RefreshedWeight]] = []
    for i, u in enumerate(units):
        w = u.dynamic_weight()
        assert w is not None and w is u.param
        weights.append((i, w))
    amaxes = torch.tensor([3.0, 5.0])
    _stamp_scales(weights, amaxes)
    float8, nvfp4 = weights[0][1], weights[1][1]
    scale = scale_from_amax(amaxes[:1], float8.float8_dtype, power_of_2=False)[0]
    assert float8.fresh_stamped_scale() == scale
    assert torch.equal(
        float8._state.stamped_scales(float8.fresh_stamped_scale()),
        torch.stack([scale, scale.reciprocal()]),
    )
    assert nvfp4.fresh_stamped_scale() == 5.0  # the amax itself, no inverse
    assert nvfp4._state.stamped_scales(nvfp4.fresh_stamped_scale()) is None
    assert not float8.needs_refresh() and not nvfp4.needs_refresh()
    with torch.no_grad():
        nvfp4.mul_(2)  # a write: the stamp is stale
    assert nvfp4.needs_refresh() and not float8.needs_refresh()
