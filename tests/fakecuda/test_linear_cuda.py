"""Fake CUDA: the three GEMMs of a Float8Linear, every recipe, on H200 (SM90) and B200
(SM100): bf16 and fp32 parameters (the latter under autocast), odd token counts, narrow
and unaligned layers with `pad_inner_dim`. A case fails naming the CUDA rule it broke
(`tests.fakecuda.fake_cuda`); the refusals the library owes a user come with a remedy."""

from __future__ import annotations

import pytest
import torch

from fsdp_float8 import CastConfig, Float8LinearConfig
from tests.fakecuda.cases import float8_gemm_calls, run_linear
from tests.fakecuda.fake_cuda import B200, H200, fake_cuda

pytestmark = pytest.mark.fakecuda

# recipe -> devices it runs on natively (mxfp8: SM100 only; blockwise: SM90 only)
DEVICES = {
    "tensorwise": {"sm90": H200, "sm100": B200},
    "rowwise": {"sm90": H200, "sm100": B200},
    "rowwise_with_gw_hp": {"sm90": H200, "sm100": B200},
    "blockwise": {"sm90": H200},
    "mxfp8": {"sm100": B200},
}
FLOAT8_GEMM_COUNT = {"rowwise_with_gw_hp": 2}  # grad_weight in high precision
# (in, out), token shape, pad_inner_dim
SHAPES = {
    "256x128_t32": ((256, 128), (32,), False),
    "256x128_t2x5": ((256, 128), (2, 5), False),  # 10 tokens: not a multiple of 16
    "32x2_pad": ((32, 2), (24,), True),  # a narrow head: N padded
    "100x200_pad": ((100, 200), (7,), True),  # K and N padded
}
BLOCK_SHAPES = {"256x256_t128": ((256, 256), (128,), False)}
CASES = [
    pytest.param(recipe, dev, shape, params, id=f"{recipe}-{dev}-{shape}-{params}")
    for recipe, devices in DEVICES.items()
    for dev in devices
    for shape in (BLOCK_SHAPES if recipe in ("blockwise", "mxfp8") else SHAPES)
    for params in ("bf16", "fp32_autocast")
]


@pytest.mark.parametrize("recipe,dev,shape,params", CASES)
def test_linear_three_gemms(recipe, dev, shape, params):
    dims, tokens, pad = (BLOCK_SHAPES | SHAPES)[shape]
    config = Float8LinearConfig.from_recipe_name(recipe, pad_inner_dim=pad)
    with fake_cuda(DEVICES[recipe][dev]) as rules:
        run_linear(config, dims, tokens, params)
    assert float8_gemm_calls(rules.calls) == FLOAT8_GEMM_COUNT.get(recipe, 3)


@pytest.mark.parametrize(
    "overrides",
    [
        {"save_input_in_float8": True},
        {"enable_fsdp_float8_all_gather": True},
        {"round_scales_to_power_of_2": True},
        {"cast_config_input": CastConfig(scaling_type="delayed")},
        {"cast_config_weight": CastConfig(scaling_type="static", static_scale=1.0)},
    ],
    ids=["save_input_fp8", "wrapped_weight", "pow2_scales", "delayed_input", "static_weight"],
)
def test_linear_tensorwise_variants(overrides):
    config = Float8LinearConfig.tensorwise(**overrides)
    with fake_cuda(H200) as rules:
        run_linear(config, (256, 128), (32,), "bf16")
    assert float8_gemm_calls(rules.calls) == 3


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("dev", ["sm90", "sm100"])
def test_rowwise_float32_layers_run_their_gemms_with_unit_scales(recipe, dev):
    # the row-scaled kernel writes bf16 only: a float32 layer without autocast runs its
    # row-scaled GEMMs as unit-scale GEMMs with a float32 output, the scales around them
    # (a rule broken fails naming it); outputs and gradients in float32
    config = Float8LinearConfig.from_recipe_name(recipe)
    with fake_cuda(DEVICES[recipe][dev]) as rules:
        run_linear(config, (256, 128), (32,), "fp32")
    assert float8_gemm_calls(rules.calls) == FLOAT8_GEMM_COUNT.get(recipe, 3)


def test_mxfp8_on_sm90_is_refused_with_a_remedy():
    with fake_cuda(H200), pytest.raises(ValueError, match="SM100"):
        run_linear(Float8LinearConfig.mxfp8(), (256, 256), (128,), "bf16")


def test_two_e5m2_operands_are_refused_when_the_config_is_built():
    # CUDA refuses e5m2 x e5m2 ('Multiplication of two Float8_e5m2 matrices'); the config
    # refuses it first, so no GPU run ever reaches the kernel with it
    e5m2 = CastConfig(target_dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="both float8_e5m2"):
        Float8LinearConfig(cast_config_input=e5m2, cast_config_weight=e5m2)


def test_joint_cast_columns_reach_the_gemms_without_a_copy():
    """The joint cast's transposed buffer (K, M + N) gives backward column-major views with
    leading dimension M + N; the CUDA float8 GEMMs take them as they are (the meta kernel's
    "mat2 must be col_major" and the kernel rules pass) with no copy of float8 bytes."""
    from fsdp_float8.core.cast_plan import CastPlan
    from fsdp_float8.core.gemm import scaled_mm_data
    from fsdp_float8.formats.tensorwise import joint_cast, joint_columns

    m, k, n = 64, 128, 96
    plan = CastPlan.from_config(Float8LinearConfig.from_recipe_name("tensorwise"))
    with fake_cuda(H200) as rules:
        x = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
        joint = joint_cast(x, w, plan)
        x_col, w_col = joint_columns(joint.columns, m, k)
        assert x_col.stride() == (1, m + n) and w_col.stride() == (1, m + n)
        go = torch.empty(m, n, device="cuda", dtype=torch.float8_e5m2)
        go_t = torch.empty(n, m, device="cuda", dtype=torch.float8_e5m2)
        one = torch.ones((), device="cuda")
        before = dict(rules.calls)
        # grad_input: go (M, N) @ w (N, K); grad_weight: go.T (N, M) @ x (M, K)
        scaled_mm_data(go, one, w_col, one, out_dtype=torch.bfloat16)
        scaled_mm_data(go_t, one, x_col, one, out_dtype=torch.bfloat16)
        new = {name: c - before.get(name, 0) for name, c in rules.calls.items()}
    assert new.get("_scaled_mm") == 2
    assert not {"clone", "copy_", "_to_copy", "contiguous"} & {n for n, c in new.items() if c}


def test_high_precision_gemm_of_16_bit_operands_keeps_a_float32_result():
    """A float32 weight's high-precision GEMM (rowwise_with_gw_hp's grad_weight, autocast's
    bf16 operands): on CUDA the body of `mm_outside_autocast` runs one GEMM with a float32
    result (`mm` with `out_dtype`, whose CUDA meta kernel takes it) and no float32 copies of
    its operands."""
    from fsdp_float8.core.gemm import _mm_outside_autocast

    with fake_cuda(H200) as rules:
        a = torch.empty(48, 32, device="cuda", dtype=torch.bfloat16)
        b = torch.empty(32, 64, device="cuda", dtype=torch.bfloat16)
        before = dict(rules.calls)
        out = _mm_outside_autocast(a, b, torch.float32)
        new = {name: c - before.get(name, 0) for name, c in rules.calls.items()}
    assert out.dtype == torch.float32 and tuple(out.shape) == (48, 64)
    assert not {"_to_copy", "copy_"} & {n for n, c in new.items() if c}, new
