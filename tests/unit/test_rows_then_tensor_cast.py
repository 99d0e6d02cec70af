"""A plain weight cast per row for the output GEMM and with one scale for grad_input
(torchao's `rowwise_with_gw_hp`): compiled for a GPU, grad_input's scale comes from the
forward's row scales (`formats.tensorwise.columns_from_row_scales`), so backward does not
read the weight for an amax (tests/gpucodegen pins the launches). Here: the same bytes,
scale and inverse as the layer's own cast, eager and compiled, and the cases it leaves to
the layer."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from fsdp_float8 import CastConfig, Float8LinearConfig, ScalingGranularity
from fsdp_float8.core.cast_plan import CastPlan
from fsdp_float8.core.gemms import Gemm, Operand
from fsdp_float8.formats import tensorwise
from fsdp_float8.nn.linear import cast_operand
from tests.unit.float8_helpers import gpu_path_runs

RECIPE = "rowwise_with_gw_hp"


def _weight(dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(0)
    w = torch.randn(96, 64) * torch.logspace(-4, 4, 96).unsqueeze(1)  # row amaxes, 8 decades
    w[5] = 0  # an all-zero row: its scale from amax 0
    w[17, 9] = -3e4  # the weight's amax, negative, in one row
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("power_of_2", [True, False])
def test_columns_from_row_scales_are_the_layers_cast(dtype, power_of_2):
    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(RECIPE), round_scales_to_power_of_2=power_of_2
    )
    plan = CastPlan.from_config(config)
    w = _weight(dtype)
    _, row_scale = cast_operand(w, Operand.WEIGHT, Gemm.OUTPUT, plan, {})
    assert row_scale.shape == (96, 1)
    (data, scale), inverse = tensorwise.columns_from_row_scales(w, row_scale, plan)
    want_data, want_scale = cast_operand(w, Operand.WEIGHT, Gemm.GRAD_INPUT, plan, {})
    assert want_scale.dim() == 0 and scale.shape == inverse.shape == (1, 64)  # K copies
    assert torch.equal(scale, want_scale.expand(1, 64))
    # the inverse the GEMM takes for a one-scale operand beside a row-scaled one (`_gemm`)
    assert torch.equal(inverse, want_scale.reciprocal().expand(1, 64))
    assert data.dtype == want_data.dtype and data.stride() == want_data.stride()
    assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))


def _amax_reads_of_weight(graphs) -> int:
    """Reductions in the backward graphs over a 2-D input of the weight's size."""
    found = 0
    for graph in graphs[1:]:
        for node in graph.graph.nodes:
            if node.target is torch.ops.aten.amax.default:
                shape = tuple(node.args[0].meta["val"].shape)
                found += shape == (96, 64)
    return found


@pytest.mark.parametrize("power_of_2", [True, False])
def test_compiled_layer_takes_the_row_scales_with_the_same_gradients(power_of_2):
    """With the CPU counted as a device where it runs (it runs on GPUs only), a compiled
    layer's grad_input scale comes from the forward's row scales (no amax over the weight
    in backward; one without), and its gradients equal eager's bit for bit."""
    config = Float8LinearConfig.from_recipe_name(RECIPE)
    # emulate: any torch's CPU GEMMs (2.11's take no row scales)
    config = dataclasses.replace(config, emulate=True, round_scales_to_power_of_2=power_of_2)
    w = _weight(torch.float32)
    torch.manual_seed(1)
    x = torch.randn(32, 64)
    results = gpu_path_runs(config, w, x, tensorwise, "ROW_SCALE_DEVICES", _amax_reads_of_weight)
    assert results["compiled here"][2] == 0 and results["compiled"][2] > 0
    for run in ("compiled", "compiled here"):
        assert torch.equal(results[run][0], results["eager"][0])
        assert torch.equal(results[run][1], results["eager"][1])


def test_row_scales_only_where_they_apply():
    w = _weight(torch.bfloat16)
    plan = CastPlan.from_config(Float8LinearConfig.from_recipe_name(RECIPE))
    gathered = CastPlan.from_config(
        Float8LinearConfig.from_recipe_name(RECIPE, enable_fsdp_float8_all_gather=True)
    )
    others = [
        CastPlan.from_config(Float8LinearConfig.from_recipe_name(r))
        for r in ("tensorwise", "rowwise")
    ]
    # one scale rule for both casts, or the least row scale is not the weight's scale
    e5m2 = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(RECIPE),
        cast_config_weight_for_grad_input=CastConfig(
            scaling_granularity=ScalingGranularity.TENSORWISE, target_dtype=torch.float8_e5m2
        ),
    )
    exact = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(RECIPE), round_scales_to_power_of_2=False
    )
    with mock.patch.object(tensorwise, "ROW_SCALE_DEVICES", ("cpu",)):
        assert not tensorwise.from_row_scales(w, plan)  # eager: the layer's own casts
        with mock.patch.object(torch.compiler, "is_compiling", lambda: True):
            assert tensorwise.from_row_scales(w, plan)
            # float8 all-gather configured: grad_input re-cast from the rows, as sharded
            assert not tensorwise.from_row_scales(w, gathered)
            assert not any(tensorwise.from_row_scales(w, p) for p in others)
            assert not tensorwise.from_row_scales(w, CastPlan.from_config(e5m2))
            assert tensorwise.from_row_scales(w, CastPlan.from_config(exact))
            assert not tensorwise.from_row_scales(w[:0], plan)  # no rows: no scale to take
            assert not tensorwise.from_row_scales(w.unsqueeze(0), plan)  # not a 2-D weight
    with mock.patch.object(torch.compiler, "is_compiling", lambda: True):
        assert not tensorwise.from_row_scales(w, plan)  # CPU: not a GPU
