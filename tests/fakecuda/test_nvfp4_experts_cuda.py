"""Fake CUDA: NVFP4 experts on B200 (SM100) run each expert's three GEMMs as `F.scaled_mm`
FP4 calls (one per expert with tokens and GEMM; nothing emulated), with bf16 parameters;
on H200 (SM90) the refusal with its remedy, and `emulate=True` running the emulated GEMMs.
Fake tensors hold no values, so the group bounds the experts read on the host are given
(`_bounds` patched to the test's token counts)."""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
import torch
from torch import nn

from fsdp_float8 import NVFP4Config, NVFP4GroupedExperts
from fsdp_float8.core import nvfp4_gemm
from fsdp_float8.experts import nvfp4_experts
from tests.fakecuda.fake_cuda import B200, H200, backward, fake_cuda
from tests.models import GroupedExperts

pytestmark = pytest.mark.fakecuda

COUNTS = [7, 0, 16, 9]  # token groups (one empty; counts not multiples of 16)


def _experts(config: NVFP4Config) -> NVFP4GroupedExperts:
    src = GroupedExperts(64, 32, len(COUNTS))
    for name in ("w1", "w2", "w3"):
        shape = getattr(src, name).shape
        w = torch.randn(shape, dtype=torch.bfloat16, device="cuda") * 0.1
        setattr(src, name, nn.Parameter(w))
    return NVFP4GroupedExperts.from_experts(src, config)


def _run(experts: NVFP4GroupedExperts) -> None:
    x = torch.randn(sum(COUNTS), 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    ends = list(itertools.accumulate(COUNTS))  # host ints: a fake tensor has no values
    bounds = list(zip([0, *ends[:-1]], ends))
    with mock.patch.object(nvfp4_experts, "_bounds", lambda offs: bounds):
        out = experts(x, torch.tensor(COUNTS, device="cuda"))
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    backward(out.float().square().sum())
    assert x.grad.shape == x.shape
    for name in experts.weight_names:
        w = getattr(experts, name)
        assert w.grad.shape == w.shape and w.grad.dtype == torch.bfloat16


def _counting_emulated_mm():
    return mock.patch.object(nvfp4_gemm, "emulated_mm", wraps=nvfp4_gemm.emulated_mm)


@pytest.mark.parametrize("all_gather", [False, True], ids=["plain", "wrapped_weight"])
def test_each_expert_runs_three_fp4_gemms_on_sm100(all_gather):
    config = NVFP4Config(enable_fsdp_float8_all_gather=all_gather)
    with fake_cuda(B200) as rules, _counting_emulated_mm() as emulated:
        _run(_experts(config))
    routed = sum(1 for c in COUNTS if c)
    assert rules.calls["_scaled_mm_v2"] == 3 * 3 * routed  # 3 weights, 3 GEMMs, per expert
    assert emulated.call_count == 0


def test_sm90_is_refused_when_the_experts_are_built():
    with fake_cuda(H200), pytest.raises(ValueError, match=r"SM100.*SM90.*emulate=True"):
        _experts(NVFP4Config())


def test_sm90_with_emulate_runs_the_emulated_gemms():
    with fake_cuda(H200) as rules, _counting_emulated_mm() as emulated:
        _run(_experts(NVFP4Config(emulate=True)))
    assert rules.calls.get("_scaled_mm_v2", 0) == 0
    assert emulated.call_count == 3 * 3 * sum(1 for c in COUNTS if c)
