"""Config validation (ValueError naming the value and the remedy), enum coercion, recipes."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from fsdp_float8 import (
    CastConfig,
    DelayedScalingConfig,
    Float8GemmConfig,
    Float8LinearConfig,
    Gemm,
    Operand,
    ScalingGranularity,
    ScalingType,
)
from fsdp_float8.core.config import E4M3, E5M2
from fsdp_float8.core.scaling import Axiswise, DelayedScaling, DynamicScaling, StaticScaling

OFF = CastConfig(scaling_type="disabled")
AXIS = CastConfig(scaling_granularity="axiswise")


@pytest.mark.parametrize("bad", [None, 0.0, -1.0])
def test_static_needs_a_positive_scale(bad) -> None:
    with pytest.raises(ValueError, match=r"static_scale > 0, got") as info:
        CastConfig(scaling_type="static", static_scale=bad)
    assert repr(bad) in str(info.value) and "static_scale=<" in str(info.value)


def test_static_scale_without_static_type() -> None:
    with pytest.raises(ValueError, match="static_scale=2.0 is only used with scaling_type=static"):
        CastConfig(static_scale=2.0)


@pytest.mark.parametrize("scaling_type", ["delayed", "static"])
def test_stateful_scaling_is_tensorwise_only(scaling_type: str) -> None:
    extra = {"static_scale": 1.0} if scaling_type == "static" else {}
    with pytest.raises(ValueError, match=f"{scaling_type} scaling is tensorwise only") as info:
        CastConfig(scaling_type=scaling_type, scaling_granularity="axiswise", **extra)
    assert "use dynamic axiswise scaling or tensorwise granularity" in str(info.value)


@pytest.mark.parametrize(
    "fields, gemm",
    [
        ({"cast_config_input": OFF}, "output"),
        ({"cast_config_weight_for_grad_input": OFF}, "grad_input"),
        ({"cast_config_input_for_grad_weight": OFF}, "grad_weight"),
    ],
)
def test_gemm_with_one_operand_disabled(fields, gemm: str) -> None:
    with pytest.raises(ValueError, match=f"the {gemm} GEMM has") as info:
        Float8LinearConfig(**fields)
    assert "disabled" in str(info.value) and "disable or enable both" in str(info.value)


def test_gemm_with_both_operands_disabled_is_fine() -> None:
    config = Float8LinearConfig(
        cast_config_input_for_grad_weight=OFF, cast_config_grad_output_for_grad_weight=OFF
    )
    assert config.strategy(Operand.INPUT, Gemm.GRAD_WEIGHT) is None
    assert config.strategy(Operand.INPUT, Gemm.OUTPUT) is not None


def test_stateful_operand_needs_one_scaling_type_for_both_uses() -> None:
    with pytest.raises(ValueError, match="input is delayed for its first GEMM but dynamic"):
        Float8LinearConfig(
            cast_config_input=CastConfig(scaling_type="delayed"),
            cast_config_input_for_grad_weight=CastConfig(),
        )


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_fsdp_float8_all_gather_works_with_every_recipe(recipe: str) -> None:
    config = Float8LinearConfig.from_recipe_name(recipe, enable_fsdp_float8_all_gather=True)
    assert config.enable_fsdp_float8_all_gather
    assert dataclasses.replace(config, enable_fsdp_float8_all_gather=False) == (
        Float8LinearConfig.from_recipe_name(recipe)
    )


def test_fsdp_float8_all_gather_refusals() -> None:
    with pytest.raises(ValueError, match="float8 weight in both weight GEMMs"):
        Float8LinearConfig(
            enable_fsdp_float8_all_gather=True,
            cast_config_weight=CastConfig(scaling_type="disabled"),
            cast_config_input=CastConfig(scaling_type="disabled"),
            cast_config_grad_output=CastConfig(scaling_type="disabled"),
        )
    with pytest.raises(ValueError, match="share the scaling type"):
        Float8LinearConfig(
            enable_fsdp_float8_all_gather=True,
            cast_config_weight=AXIS,
            cast_config_input=AXIS,
            cast_config_weight_for_grad_input=CastConfig(scaling_type="static", static_scale=2.0),
        )


def test_fsdp_float8_all_gather_needs_one_weight_cast() -> None:
    with pytest.raises(ValueError, match="same dtype and scaling type"):
        Float8LinearConfig(
            enable_fsdp_float8_all_gather=True,
            cast_config_weight_for_grad_input=CastConfig(target_dtype=E5M2),
        )


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_save_input_in_float8_needs_tensorwise_input(recipe: str) -> None:
    with pytest.raises(ValueError, match="save_input_in_float8=True") as info:
        Float8LinearConfig.from_recipe_name(recipe, save_input_in_float8=True)
    assert "set save_input_in_float8=False" in str(info.value)
    with pytest.raises(ValueError, match="save_input_in_float8=True"):
        Float8LinearConfig(cast_config_input=AXIS, save_input_in_float8=True)


def test_unknown_recipe() -> None:
    with pytest.raises(ValueError, match=r"unknown float8 recipe 'colwise'") as info:
        Float8LinearConfig.from_recipe_name("colwise")
    assert "['blockwise', 'mxfp8', 'rowwise', 'rowwise_with_gw_hp', 'tensorwise']" in str(
        info.value
    )


@pytest.mark.parametrize(
    "field, value, valid",
    [
        ("scaling_type", "dynamc", "'dynamic', 'delayed', 'static', 'disabled'"),
        ("scaling_granularity", "rowwise", "'tensorwise', 'axiswise'"),
    ],
)
def test_bad_enum_strings(field: str, value: str, valid: str) -> None:
    with pytest.raises(ValueError, match=f"{field}='{value}' is not valid") as info:
        CastConfig(**{field: value})
    assert valid in str(info.value)


def test_bad_target_dtype_and_delayed_scaling_config() -> None:
    with pytest.raises(ValueError, match="target_dtype=torch.bfloat16 is not a float8 dtype"):
        CastConfig(target_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="history_len must be an int >= 1, got 0"):
        DelayedScalingConfig(history_len=0)
    with pytest.raises(ValueError, match="scale_fn_name='mean'; expected 'max' or 'most_recent'"):
        DelayedScalingConfig(scale_fn_name="mean")
    with pytest.raises(ValueError, match="max_forwards_without_sync must be >= 1, got 0"):
        DelayedScalingConfig(max_forwards_without_sync=0)


def test_enum_strings_are_coerced_and_configs_are_frozen() -> None:
    cfg = CastConfig(scaling_type="delayed", scaling_granularity="tensorwise")
    assert cfg.scaling_type is ScalingType.DELAYED
    assert cfg.scaling_granularity is ScalingGranularity.TENSORWISE
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.scaling_type = ScalingType.STATIC
    # torchao's fields are positional (tests/unit/test_torchao_compat.py); ours are not
    assert CastConfig("delayed") == cfg
    with pytest.raises(TypeError, match="positional"):
        DelayedScalingConfig(16, "max", 64)
    fields = dataclasses.fields(Float8LinearConfig)
    positional = [getattr(Float8LinearConfig(), f.name) for f in fields if not f.kw_only]
    assert Float8LinearConfig(*positional) == Float8LinearConfig()
    with pytest.raises(TypeError, match="positional"):
        Float8LinearConfig(*positional, DelayedScalingConfig())


def test_recipes() -> None:
    tw = Float8LinearConfig.from_recipe_name("tensorwise")
    assert tw == Float8LinearConfig.tensorwise() == Float8LinearConfig()
    assert tw.float8_dtype(Operand.GRAD_OUTPUT, Gemm.GRAD_INPUT) == E5M2
    assert tw.float8_dtype(Operand.INPUT, Gemm.OUTPUT) == E4M3

    rw = Float8LinearConfig.rowwise()
    assert rw.round_scales_to_power_of_2
    for operand, gemm in _USES:
        strategy = rw.strategy(operand, gemm)
        assert isinstance(strategy, DynamicScaling) and strategy.power_of_2
        assert isinstance(strategy.granularity, Axiswise)
        assert rw.float8_dtype(operand, gemm) == E4M3

    gw_hp = Float8LinearConfig.rowwise_with_gw_hp(emulate=True)
    assert gw_hp.emulate
    assert gw_hp.strategy(Operand.INPUT, Gemm.GRAD_WEIGHT) is None
    assert gw_hp.strategy(Operand.GRAD_OUTPUT, Gemm.GRAD_WEIGHT) is None
    w_gi = gw_hp.strategy(Operand.WEIGHT, Gemm.GRAD_INPUT)
    assert not isinstance(w_gi.granularity, Axiswise)


_USES = {
    (Operand.INPUT, Gemm.OUTPUT),
    (Operand.INPUT, Gemm.GRAD_WEIGHT),
    (Operand.WEIGHT, Gemm.OUTPUT),
    (Operand.WEIGHT, Gemm.GRAD_INPUT),
    (Operand.GRAD_OUTPUT, Gemm.GRAD_INPUT),
    (Operand.GRAD_OUTPUT, Gemm.GRAD_WEIGHT),
}


def test_strategy_objects_follow_the_config() -> None:
    config = Float8LinearConfig(
        cast_config_input=CastConfig(scaling_type="static", static_scale=4.0),
        cast_config_weight=CastConfig(scaling_type="delayed"),
        delayed_scaling_config=DelayedScalingConfig(history_len=5, scale_fn_name="most_recent"),
        round_scales_to_power_of_2=True,
    )
    assert config.strategy(Operand.INPUT, Gemm.GRAD_WEIGHT) == StaticScaling(scale=4.0)
    delayed = config.strategy(Operand.WEIGHT, Gemm.GRAD_INPUT)
    assert delayed == DelayedScaling(history_len=5, scale_fn_name="most_recent", power_of_2=True)
    assert config.scaling_types() == {ScalingType.STATIC, ScalingType.DELAYED, ScalingType.DYNAMIC}


@pytest.mark.parametrize(
    "build, field, expected",
    [
        (lambda: Float8LinearConfig(emulate="False"), "Float8LinearConfig.emulate='False'", "bool"),
        (
            lambda: Float8LinearConfig(cast_config_input={"scaling_type": "dynamic"}),
            "Float8LinearConfig.cast_config_input={'scaling_type': 'dynamic'}",
            "CastConfig",
        ),
        (
            lambda: Float8LinearConfig(delayed_scaling_config=None),
            "Float8LinearConfig.delayed_scaling_config=None",
            "DelayedScalingConfig",
        ),
        (
            lambda: Float8LinearConfig(gemm_config_output=True),
            "Float8LinearConfig.gemm_config_output=True",
            "Float8GemmConfig",
        ),
        (lambda: DelayedScalingConfig(history_len=True), "history_len=True", "int"),
        (lambda: DelayedScalingConfig(max_forwards_without_sync=2.5), "sync=2.5", "int"),
        (
            lambda: CastConfig(scaling_type="static", static_scale="64"),
            "CastConfig.static_scale='64'",
            "float or None",
        ),
        (lambda: CastConfig(scaling_type=3), "CastConfig.scaling_type=3", "ScalingType"),
        (lambda: CastConfig(target_dtype="e4m3"), "target_dtype='e4m3'", "dtype or None"),
        (lambda: Float8GemmConfig(use_fast_accum=1), "use_fast_accum=1", "bool"),
    ],
)
def test_wrongly_typed_fields_name_the_field_value_and_type(build, field, expected) -> None:
    with pytest.raises(TypeError) as info:
        build()
    message = str(info.value)
    assert field in message and f"expected {expected}" in message, message


def test_numbers_of_another_python_type_are_accepted() -> None:
    assert CastConfig(scaling_type="static", static_scale=64).static_scale == 64
    assert DelayedScalingConfig(history_len=4).history_len == 4


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 1e-45, 1e-35, 1e38])
def test_static_scale_outside_the_float32_safe_range(bad: float) -> None:
    # 1e-45: fp8_max / scale overflows float32 (outputs NaN); 1e38: 1 / scale underflows
    with pytest.raises(
        ValueError, match=re.escape(f"static_scale={bad!r}") + "|" + re.escape(f"got {bad!r}")
    ) as info:
        CastConfig(scaling_type="static", static_scale=bad)
    assert "fp8_max / expected amax" in str(info.value)


def test_static_scale_range_edges_are_usable() -> None:
    # the bounds are where the arithmetic still works: check the cast and inv_scale there
    f32 = torch.finfo(torch.float32)
    for scale in (448.0 / f32.max * 1.01, 1 / f32.tiny * 0.99):
        cfg = CastConfig(scaling_type="static", static_scale=scale, target_dtype=E4M3)
        s = torch.tensor(cfg.static_scale, dtype=torch.float32)
        assert torch.isfinite(448.0 / s) and s.reciprocal() > 0


@pytest.mark.parametrize(
    "fields,gemm",
    [
        ({"cast_config_input": CastConfig(target_dtype=E5M2)}, "grad_weight"),
        ({"cast_config_weight": CastConfig(target_dtype=E5M2)}, "grad_input"),
        (
            {
                "cast_config_input": CastConfig(target_dtype=E5M2),
                "cast_config_weight": CastConfig(target_dtype=E5M2),
                "cast_config_grad_output": CastConfig(target_dtype=E4M3),
            },
            "output",
        ),
    ],
)
def test_two_e5m2_operands_of_a_gemm_are_refused_at_build(fields, gemm) -> None:
    # CUDA torch._scaled_mm refuses e5m2 x e5m2 (the CPU kernel runs it): refuse it before
    # a GPU does, unless the GEMMs are emulated
    with pytest.raises(ValueError, match=f"the {gemm} GEMM .* both float8_e5m2") as info:
        Float8LinearConfig(**fields)
    assert "float8_e4m3fn" in str(info.value) and "emulate=True" in str(info.value)
    Float8LinearConfig(**fields, emulate=True)


@pytest.mark.parametrize(
    "delayed",
    [{"history_len": 4}, {"scale_fn_name": "most_recent"}, {"max_forwards_without_sync": 8}],
)
def test_delayed_scaling_config_without_a_delayed_cast_is_refused(delayed) -> None:
    # it would change nothing: only delayed casts read it
    config = DelayedScalingConfig(**delayed)
    with pytest.raises(ValueError, match="no cast is delayed") as info:
        Float8LinearConfig(delayed_scaling_config=config)
    assert "scaling_type='delayed'" in str(info.value)
    assert "drop delayed_scaling_config" in str(info.value)
    with pytest.raises(ValueError, match="no cast is delayed"):
        Float8LinearConfig.from_recipe_name("rowwise", delayed_scaling_config=config)
    delayed_input = CastConfig(scaling_type="delayed")
    kept = Float8LinearConfig(cast_config_input=delayed_input, delayed_scaling_config=config)
    assert kept.delayed_scaling_config == config
    assert Float8LinearConfig(delayed_scaling_config=DelayedScalingConfig()).emulate is False


def test_power_of_2_rounding_refuses_a_static_scale_it_would_not_round() -> None:
    # a static scale is used as given: under round_scales_to_power_of_2 it must be one
    static = CastConfig(scaling_type="static", static_scale=3.0)
    with pytest.raises(ValueError, match=r"cast_config_input has static_scale=3.0") as info:
        Float8LinearConfig(cast_config_input=static, round_scales_to_power_of_2=True)
    message = str(info.value)
    assert "static_scale=2.0" in message and "round_scales_to_power_of_2=False" in message
    power = CastConfig(scaling_type="static", static_scale=0.25)
    config = Float8LinearConfig(cast_config_weight=power, round_scales_to_power_of_2=True)
    assert config.strategy(Operand.WEIGHT, Gemm.GRAD_INPUT) == StaticScaling(scale=0.25)
    assert Float8LinearConfig(cast_config_input=static).cast_config_input.static_scale == 3.0


@pytest.mark.parametrize(
    "config, cast",
    [
        ({"cast_config_input": CastConfig(scaling_type="delayed")}, "delayed"),
        ({"cast_config_input": CastConfig(scaling_type="static", static_scale=4.0)}, "static"),
        (
            {
                "cast_config_input_for_grad_weight": CastConfig(scaling_type="disabled"),
                "cast_config_grad_output_for_grad_weight": CastConfig(scaling_type="disabled"),
            },
            "disabled",
        ),
    ],
)
def test_share_input_casts_refuses_input_casts_it_cannot_share(config, cast) -> None:
    # only dynamic casts of both input uses are shared: anything else would share nothing
    with pytest.raises(ValueError, match="share_input_casts=True") as info:
        Float8LinearConfig(share_input_casts=True, **config)
    message = str(info.value)
    assert cast in message and "share_input_casts=False" in message
    with pytest.raises(ValueError, match="share_input_casts=True"):
        Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp", share_input_casts=True)
    assert Float8LinearConfig(**config).share_input_casts is False
    shared = Float8LinearConfig.from_recipe_name("rowwise", share_input_casts=True)
    assert shared.share_input_casts is True


HP_GRAD_WEIGHT = {
    "cast_config_input_for_grad_weight": OFF,
    "cast_config_grad_output_for_grad_weight": OFF,
}


@pytest.mark.parametrize(
    "fields, gemm, why",
    [
        (
            {**HP_GRAD_WEIGHT, "gemm_config_grad_weight": Float8GemmConfig(True)},
            "grad_weight",
            "runs in high precision",
        ),
        (
            {"gemm_config_grad_input": Float8GemmConfig(True)},
            "grad_input",
            "MX GEMM",
        ),
        (
            {"gemm_config_output": Float8GemmConfig(False)},
            "output",
            "MX GEMM",
        ),
    ],
)
def test_fast_accum_a_gemm_does_not_read_is_refused(fields, gemm: str, why: str) -> None:
    # a high-precision GEMM and an MX (e8m0-scaled) GEMM take no fast-accumulation setting:
    # a non-default one would change nothing
    build = Float8LinearConfig.mxfp8 if why == "MX GEMM" else Float8LinearConfig
    with pytest.raises(ValueError, match=f"gemm_config_{gemm}=") as info:
        build(**fields)
    message = str(info.value)
    assert why in message and f"the {gemm} GEMM" in message
    assert f"drop gemm_config_{gemm}" in message


def test_fast_accum_defaults_and_float8_gemms_are_accepted() -> None:
    # the defaults are accepted where they are not read (output's use_fast_accum=True with
    # an MX or high-precision output GEMM); a float8 GEMM takes any setting
    assert Float8LinearConfig.mxfp8().gemm_config_output.use_fast_accum is True
    assert Float8LinearConfig.rowwise_with_gw_hp().gemm_config_grad_weight == Float8GemmConfig()
    fast = Float8GemmConfig(True)
    assert Float8LinearConfig.rowwise_with_gw_hp(gemm_config_grad_input=fast)
    assert Float8LinearConfig.blockwise(gemm_config_grad_weight=fast)
    assert Float8LinearConfig(**HP_GRAD_WEIGHT, gemm_config_output=Float8GemmConfig(False))
