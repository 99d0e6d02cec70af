"""A plain rowwise weight's grad_input operand cast along its columns by its format
(`formats.rowwise.column_cast`), compiled for a GPU: the amax over a transposed copy, so
GPU Inductor fuses copy, amax and cast into one kernel (tests/gpucodegen pins the launches).
Here: the same bytes and scales as the layer's own cast, eager and compiled, and the cases
it leaves to the layer."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from fsdp_float8 import Float8LinearConfig
from fsdp_float8.core.cast_plan import CastPlan
from fsdp_float8.core.gemms import Gemm, Operand
from fsdp_float8.formats import rowwise
from fsdp_float8.formats.weight_operands import weight_for
from fsdp_float8.nn.linear import cast_operand
from tests.unit.float8_helpers import gpu_path_runs


def _weight(dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(0)
    w = torch.randn(96, 64) * torch.logspace(-4, 4, 64)  # column amaxes over 8 decades
    w[:, 5] = 0  # an all-zero column: scale from amax 0
    w[17, 9] = 3e4  # an outlier in one column
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_column_cast_is_the_layers_cast(dtype):
    plan = CastPlan.from_config(Float8LinearConfig.from_recipe_name("rowwise"))
    w = _weight(dtype)
    data, scale = rowwise.column_cast(w, plan)
    want_data, want_scale = cast_operand(w, Operand.WEIGHT, Gemm.GRAD_INPUT, plan, {})
    assert scale.shape == want_scale.shape == (1, 64)
    assert torch.equal(scale, want_scale)
    assert data.dtype == want_data.dtype and data.stride() == want_data.stride()
    assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))


def _strided_ops(graphs) -> int:
    return sum(
        node.target is torch.ops.aten.as_strided.default
        for graph in graphs
        for node in graph.graph.nodes
    )


@pytest.mark.parametrize("power_of_2", [True, False])
def test_compiled_layer_takes_the_column_cast_with_the_same_gradients(power_of_2):
    """With the CPU counted as a device where it runs (it runs on GPUs only), a compiled
    layer's backward takes `column_cast`'s operand (its transposed copy's `as_strided` is in
    the graphs; not without it), and its gradients equal eager's bit for bit."""
    config = Float8LinearConfig.from_recipe_name("rowwise")
    # emulate: any torch's CPU GEMMs (2.11's take no row scales)
    config = dataclasses.replace(config, emulate=True, round_scales_to_power_of_2=power_of_2)
    torch.manual_seed(1)
    w = torch.randn(96, 64) * torch.logspace(-3, 3, 64)
    x = torch.randn(32, 64)
    results = gpu_path_runs(config, w, x, rowwise, "COLUMN_CAST_DEVICES", _strided_ops)
    assert results["compiled here"][2] > 0 and results["compiled"][2] == 0
    for run in ("compiled", "compiled here"):
        assert torch.equal(results[run][0], results["eager"][0])
        assert torch.equal(results[run][1], results["eager"][1])


def test_column_cast_only_where_it_applies():
    w = _weight(torch.bfloat16)
    rows = CastPlan.from_config(Float8LinearConfig.from_recipe_name("rowwise"))
    gathered = CastPlan.from_config(
        Float8LinearConfig.from_recipe_name("rowwise", enable_fsdp_float8_all_gather=True)
    )
    tensorwise = CastPlan.from_config(Float8LinearConfig.from_recipe_name("tensorwise"))
    # grad_input's weight in one scale (torchao's recipe): no column scales to make
    gw_hp = CastPlan.from_config(Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp"))
    with mock.patch.object(rowwise, "COLUMN_CAST_DEVICES", ("cpu",)):
        # eager: the layer's own cast (the one-kernel form needs Inductor)
        assert rowwise.plain_operand(w, Gemm.GRAD_INPUT, rows) is None
        with mock.patch.object(torch.compiler, "is_compiling", lambda: True):
            assert rowwise.plain_operand(w, Gemm.GRAD_INPUT, rows) is not None
            assert rowwise.plain_operand(w, Gemm.OUTPUT, rows) is None
            assert rowwise.plain_operand(w, Gemm.GRAD_INPUT, gw_hp) is None
            # float8 all-gather configured: grad_input re-cast from the rows, as sharded
            assert rowwise.plain_operand(w, Gemm.GRAD_INPUT, gathered) is None
            # another family: weight_for never asks this place
            data, scale = weight_for(w, Gemm.GRAD_INPUT, tensorwise, cast_operand, {})
            assert scale.dim() == 0
    with mock.patch.object(torch.compiler, "is_compiling", lambda: True):
        assert rowwise.plain_operand(w, Gemm.GRAD_INPUT, rows) is None  # CPU: not a GPU


def test_column_cast_of_a_column_major_view():
    """A weight that is a transposed view of a slice (its transpose already contiguous, at a
    storage offset): the transposed copy is a fresh buffer, not the view read from offset 0."""
    plan = CastPlan.from_config(Float8LinearConfig.from_recipe_name("rowwise"))
    base = _weight(torch.bfloat16).t().contiguous()  # (64, 96)
    padded = torch.cat([torch.full((1, 96), 1e4, dtype=torch.bfloat16), base])
    w = padded[1:].t()  # (96, 64), column-major, storage offset 96
    assert w.t().is_contiguous() and w.t().storage_offset() == 96
    data, scale = rowwise.column_cast(w, plan)
    want_data, want_scale = cast_operand(w, Operand.WEIGHT, Gemm.GRAD_INPUT, plan, {})
    assert torch.equal(scale, want_scale)
    assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))
