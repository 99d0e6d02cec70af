"""The torchtitan integration's pieces, single process, models built on the meta device as
torchtitan builds them: the converter with every recipe and scaling type, the override on a
stock config, `--config` names, and bad input refused with a remedy."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.integrations.titan_cpu import stub_triton_kernels

pytestmark = pytest.mark.extras
if importlib.util.find_spec("torchtitan") is not None:
    stub_triton_kernels()  # torchtitan imports triton kernels; a CPU machine has no triton
pytest.importorskip("torchtitan")
tt = pytest.importorskip("fsdp_float8.integrations.torchtitan")

from fsdp_float8 import Float8LinearConfig, ScalingType  # noqa: E402
from fsdp_float8.weight_wrappers.wrap import Float8WeightWrapper  # noqa: E402

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8"]


def _debug_spec(converter=None):
    from torchtitan.models.llama3 import model_registry

    return model_registry("debugmodel", converters=[converter] if converter else None)


def _build(model_config):
    with torch.device("meta"):
        model = model_config.build()
    model.verify_module_protocol()  # torchtitan's check: every submodule is a Module
    return model


def _float8_layers(model) -> dict[str, tt.Float8TitanLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, tt.Float8TitanLinear)}


@pytest.mark.parametrize("recipe", RECIPES)
def test_converter_builds_every_recipe_with_float8_all_gather(recipe: str) -> None:
    spec = _debug_spec(tt.Float8Converter.Config(recipe_name=recipe))
    layers = _float8_layers(_build(spec.model))
    assert len(layers) == 6 * 5 and not any("lm_head" in n for n in layers)
    expected = Float8LinearConfig.from_recipe_name(recipe, enable_fsdp_float8_all_gather=True)
    for layer in layers.values():
        assert layer.config == expected
        assert isinstance(layer.weight, Float8WeightWrapper)


@pytest.mark.parametrize("scaling", ["delayed", "static"])
def test_converter_takes_every_tensorwise_scaling_type(scaling: str) -> None:
    converter = tt.Float8Converter.Config(
        scaling_type_input=scaling, scaling_type_weight=scaling, static_scale=1.0
    )
    layers = _float8_layers(_build(_debug_spec(converter).model))
    config = next(iter(layers.values())).config
    assert config.cast_config_input.scaling_type == ScalingType(scaling)
    assert config.cast_config_weight.scaling_type == ScalingType(scaling)
    assert config.cast_config_grad_output.scaling_type == ScalingType.DYNAMIC


def test_bad_scaling_type_is_refused_at_converter_build() -> None:
    with pytest.raises(ValueError, match="scaling_type_weight='dynamc'; expected one of"):
        tt.Float8Converter.Config(scaling_type_weight="dynamc").build()


def test_filter_fqns_and_all_gather_switch() -> None:
    converter = tt.Float8Converter.Config(
        filter_fqns=["feed_forward", "lm_head"], enable_fsdp_float8_all_gather=False
    )
    layers = _float8_layers(_build(_debug_spec(converter).model))
    assert len(layers) == 6 * 2 and all("attention" in n for n in layers)
    assert not any(isinstance(m.weight, Float8WeightWrapper) for m in layers.values())


def test_filter_fqns_as_one_string_is_one_fqn() -> None:
    # torchtitan's own filter would test each character of a string: here it is one name
    one = tt.Float8Converter.Config(filter_fqns="lm_head")
    listed = tt.Float8Converter.Config(filter_fqns=["lm_head"])
    layers = _float8_layers(_build(_debug_spec(one).model))
    assert layers and sorted(layers) == sorted(_float8_layers(_build(_debug_spec(listed).model)))
    with pytest.raises(TypeError, match="filter_fqns=.*expected a list of non-empty strings"):
        tt.Float8Converter.Config(filter_fqns=["lm_head", ""]).build()


def test_override_on_the_stock_config_swaps_block_linears_only() -> None:
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    targets = [f"{tt.__name__}.float8_linears", f"{tt.__name__}.float8_step"]
    lines = apply_overrides(OverrideConfig(imports=targets), config)
    assert sum("float8_linears" in line for line in lines) == 30
    assert sum("float8_step" in line for line in lines) == 1
    assert type(config.optimizer)._owner.__name__ == "Float8StepOptimizersContainer"
    layers = _float8_layers(_build(config.model_spec.model))
    assert len(layers) == 30 and not any("lm_head" in n for n in layers)


def test_override_kwargs_choose_the_recipe() -> None:
    from torchtitan.models.common.linear import Linear

    cfg = Linear.Config(in_features=256, out_features=512)
    new = tt.float8_linears(cfg, recipe_name="rowwise")
    assert new._float8 == Float8LinearConfig.from_recipe_name(
        "rowwise", enable_fsdp_float8_all_gather=True
    )
    assert tt.float8_linears(Linear.Config(in_features=256, out_features=8)) is not None


def test_module_config_names_wrap_stock_configs() -> None:
    config = tt.llama3_debugmodel()
    assert config.model_spec.post_optimizer_build_fn is tt.float8_post_optimizer_build
    assert len(_float8_layers(_build(config.model_spec.model))) == 30
    with pytest.raises(AttributeError, match="takes the name of a torchtitan config function"):
        tt.llama3_no_such_flavor  # noqa: B018


def test_with_float8_runs_after_the_specs_own_post_optimizer_build() -> None:
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    calls = []
    config = llama3_debugmodel()
    config.model_spec.post_optimizer_build_fn = lambda *args: calls.append("own")
    config = tt.with_float8(config)
    model = _build(config.model_spec.model)
    config.model_spec.post_optimizer_build_fn(torch.optim.SGD(model.parameters(), lr=0.1), [])
    assert calls == ["own"]
