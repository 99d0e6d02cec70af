"""The output GEMM's input and weight cast as one (`formats.tensorwise.joint_cast`, what a
compiled tensorwise `Float8Linear` with a plain weight runs on a GPU): the same float8 bytes
and scales as the two separate casts, in both layouts, and the layer's compiled results
equal to eager ones, bit for bit. The GPU-codegen lane counts its kernels."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fsdp_float8 import Float8Linear, Float8LinearConfig
from fsdp_float8.core.cast_plan import CastPlan
from fsdp_float8.core.gemms import Gemm, Operand
from fsdp_float8.formats.tensorwise import joint_cast, joint_columns
from fsdp_float8.nn import linear as linear_module
from fsdp_float8.nn.linear import cast_operand
from tests.unit.float8_helpers import make_config


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# (input dtype, weight dtype): one dtype, or an input under autocast beside a float32 weight
DTYPES = [
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
]


@pytest.mark.parametrize("power_of_2", [False, True])
@pytest.mark.parametrize("dtypes", DTYPES, ids=str)
@pytest.mark.parametrize(
    "x_range, w_range", [(1.0, 0.05), (3e-4, 40.0), (0.0, 1.0), (1.0, 0.0)], ids=str
)
def test_joint_cast_equals_the_separate_casts(power_of_2, dtypes, x_range, w_range):
    torch.manual_seed(0)
    config = Float8LinearConfig.from_recipe_name("tensorwise")
    if power_of_2:
        config = Float8LinearConfig(round_scales_to_power_of_2=True)
    plan = CastPlan.from_config(config)
    assert plan.joint_output_cast()
    x = (torch.randn(48, 64) * x_range).to(dtypes[0])
    w = (torch.randn(32, 64) * w_range).to(dtypes[1])
    joint = joint_cast(x, w, plan)
    x_ref = cast_operand(x, Operand.INPUT, Gemm.OUTPUT, plan, {})
    w_ref = cast_operand(w, Operand.WEIGHT, Gemm.OUTPUT, plan, {})
    for (data, scale), (ref_data, ref_scale) in ((joint.x, x_ref), (joint.w, w_ref)):
        assert torch.equal(scale, ref_scale)
        assert data.shape == ref_data.shape and data.stride() == ref_data.stride()
        assert torch.equal(_bytes(data), _bytes(ref_data))
    x_col, w_col = joint_columns(joint.columns, 48, 64)
    # column-major, leading dimension M + N: views of one (K, M + N) buffer
    assert x_col.stride() == (1, 80) and w_col.stride() == (1, 80)
    assert torch.equal(_bytes(x_col), _bytes(x_ref[0])) and torch.equal(
        _bytes(w_col), _bytes(w_ref[0])
    )


def test_only_dynamic_tensorwise_plans_join():
    assert not CastPlan.from_config(make_config("rowwise", "dynamic")).joint_output_cast()
    for scaling in ("delayed", "static"):
        assert not CastPlan.from_config(make_config("tensorwise", scaling)).joint_output_cast()


def _steps(layer: nn.Module, xs: list[torch.Tensor], autocast=False) -> list[torch.Tensor]:
    got = []
    for x in xs:
        x = x.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):  # backward outside
            y = layer(x)
        y.float().square().sum().backward()
        got += [y.detach(), x.grad]
    return got + [layer.weight.grad]


@pytest.mark.parametrize("tokens", [32, 24], ids=["joint", "unaligned_separate"])
def test_compiled_layer_equals_eager(tokens, monkeypatch):
    """32 tokens take the joint cast when compiled; 24 (not a multiple of 16) the separate
    casts: both bit-equal to eager, forward and both gradients."""
    traced = []

    def counted(*args):
        traced.append(args[0].shape)
        return joint_cast(*args)

    monkeypatch.setattr(linear_module, "joint_cast", counted)
    # a GPU's path, taken here on the CPU (`JOINT_CAST_DEVICES`): the same graph code
    monkeypatch.setattr(linear_module, "JOINT_CAST_DEVICES", ("cuda", "cpu"))
    torch.manual_seed(0)
    eager = Float8Linear.from_float(
        nn.Linear(64, 48, bias=False), make_config("tensorwise", "dynamic")
    )
    compiled = torch.compile(copy.deepcopy(eager), backend="aot_eager", fullgraph=True)
    xs = [torch.randn(tokens, 64) * s for s in (1.0, 7.0)]
    for a, b in zip(_steps(eager, xs), _steps(compiled, xs), strict=True):
        assert torch.equal(a, b)
    assert bool(traced) == (tokens % 16 == 0)  # while tracing only: never in eager


def test_compiled_layer_under_autocast_takes_the_joint_cast(monkeypatch):
    """A float32 layer under bf16 autocast (its input cast to bf16, its weight cast from
    float32): the joint cast stacks both in float32 (exact for bf16), and the compiled
    layer equals eager bit for bit."""
    traced = []

    def counted(*args):
        traced.append((args[0].dtype, args[1].dtype))
        return joint_cast(*args)

    monkeypatch.setattr(linear_module, "joint_cast", counted)
    monkeypatch.setattr(linear_module, "JOINT_CAST_DEVICES", ("cuda", "cpu"))
    torch._dynamo.reset()  # no graph of another test's patches
    torch.manual_seed(0)
    eager = Float8Linear.from_float(
        nn.Linear(64, 48, bias=False), make_config("tensorwise", "dynamic")
    )
    compiled = torch.compile(copy.deepcopy(eager), backend="aot_eager", fullgraph=True)
    xs = [torch.randn(32, 64) * s for s in (1.0, 7.0)]
    for a, b in zip(_steps(eager, xs, autocast=True), _steps(compiled, xs, autocast=True)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert traced and set(traced) == {(torch.bfloat16, torch.float32)}


def test_cpu_compile_keeps_the_separate_casts(monkeypatch):
    """On the CPU a compiled layer casts input and weight apart (CPU Inductor lowers the
    stacked form into more kernels)."""
    traced = []
    monkeypatch.setattr(linear_module, "joint_cast", lambda *a: traced.append(1))
    layer = Float8Linear.from_float(
        nn.Linear(64, 48, bias=False), make_config("tensorwise", "dynamic")
    )
    torch.compile(layer, backend="aot_eager", fullgraph=True)(torch.randn(32, 64))
    assert traced == []
