"""The CUDA `torch._scaled_mm` contract, checked on CPU.

- CUDA needs K and N (both dims of the second operand) to be multiples of 16. CPU does
  not, so a stand-in `torch._scaled_mm` that enforces the CUDA shape and layout rules runs a
  `Linear(32, 2)` head (and other odd shapes) with `pad_inner_dim=True`: outputs and
  gradients keep their shapes and the float8 SQNR bars.
- Row-scaled GEMMs with a non-bf16 output (a float32 layer's) run as unit-scale GEMMs
  with the scales around them, as on CUDA, whose row-scaled kernel writes bf16 only
  (on CPU inside `cuda_gemm_rules_on_cpu()`).
- A CUDA device below compute capability 8.9 is refused at convert time, naming
  `emulate=True`.
- FSDP2 CPU offload with float8 all-gather is refused at the first all-gather.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fsdp_float8 import Float8Linear, Float8LinearConfig, convert_to_float8_training, sqnr_db
from fsdp_float8.core._compat import cpu_scaled_mm_takes_row_scales
from fsdp_float8.core.gemm import cuda_gemm_rules_on_cpu
from fsdp_float8.core.numerics import SQNR_DB

_real_scaled_mm = torch._scaled_mm


def _cuda_contract_scaled_mm(a, b, scale_a, scale_b, **kwargs):
    k, n = b.shape
    assert a.shape[1] % 16 == 0 and k % 16 == 0 and n % 16 == 0, (tuple(a.shape), (k, n))
    assert a.is_contiguous() and b.t().is_contiguous(), "a row-major, b column-major"
    return _real_scaled_mm(a, b, scale_a, scale_b, **kwargs)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dims", [(32, 2), (20, 24), (48, 17)], ids=str)
def test_pad_inner_dim_pads_k_and_n_for_the_cuda_contract(monkeypatch, recipe, dims):
    cpu_scaled_mm_takes_row_scales()  # its one-off probe GEMM (2x16x2) is not the layer's
    monkeypatch.setattr(torch, "_scaled_mm", _cuda_contract_scaled_mm)
    in_features, out_features = dims
    torch.manual_seed(0)
    ref = nn.Linear(in_features, out_features, bias=False)
    config = Float8LinearConfig.from_recipe_name(recipe, pad_inner_dim=True)
    layer = Float8Linear.from_float(nn.Linear(in_features, out_features, bias=False), config)
    layer.weight = nn.Parameter(ref.weight.detach().clone())
    x = torch.randn(5, in_features, requires_grad=True)  # 5 tokens: not a multiple of 16
    x_ref = x.detach().clone().requires_grad_()
    out, out_ref = layer(x), ref(x_ref)
    assert out.shape == (5, out_features)
    grad = torch.randn_like(out_ref)
    out.backward(grad)
    out_ref.backward(grad)
    assert sqnr_db(out_ref, out) >= SQNR_DB["linear_output"]
    assert sqnr_db(x_ref.grad, x.grad) >= SQNR_DB["linear_grad_input"]
    assert sqnr_db(ref.weight.grad, layer.weight.grad) >= SQNR_DB["linear_grad_weight"]


def _cuda_output_rule_scaled_mm(a, b, scale_a, scale_b, **kwargs):
    # CUDA's row-scaled kernel writes bfloat16 only (float16 too on some builds: not asked)
    if scale_a.dim() or scale_b.dim():
        assert kwargs.get("out_dtype") == torch.bfloat16, ("row scales", kwargs.get("out_dtype"))
    return _real_scaled_mm(a, b, scale_a, scale_b, **kwargs)


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "fp32_autocast"])
def test_float32_layers_keep_the_cuda_output_rule(monkeypatch, recipe, autocast):
    # a float32 layer's row-scaled GEMMs (all three without autocast; grad_weight with it)
    # ask for float32, which CUDA's row-scaled kernel does not write: they run as unit-scale
    # GEMMs with the scales around them, in float32, and give the layer's dtypes
    cpu_scaled_mm_takes_row_scales()  # its one-off probe GEMM is not the layer's
    monkeypatch.setattr(torch, "_scaled_mm", _cuda_output_rule_scaled_mm)
    torch.manual_seed(0)
    ref = nn.Linear(64, 32)
    config = Float8LinearConfig.from_recipe_name(recipe)
    layer = Float8Linear.from_float(nn.Linear(64, 32), config)
    emulated = Float8Linear.from_float(nn.Linear(64, 32), replace(config, emulate=True))
    for m in (layer, emulated):
        m.load_state_dict(ref.state_dict())
    x = torch.randn(48, 64)
    grad = torch.randn(48, 32)
    outs, weight_grads = [], []
    for m in (layer, emulated, ref):
        with cuda_gemm_rules_on_cpu(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = m(x)
            out.backward(grad.to(out.dtype))
        outs.append(out.float())
        weight_grads.append(m.weight.grad)
    assert outs[0].dtype == torch.float32 and layer.weight.grad.dtype == torch.float32
    assert (out.dtype == torch.bfloat16) == autocast
    assert sqnr_db(outs[2], outs[0]) >= SQNR_DB["linear_output"]
    assert sqnr_db(weight_grads[2], weight_grads[0]) >= SQNR_DB["linear_grad_weight"]
    # the same float8 operands as the emulation: equal to float32 rounding (bf16 rounding
    # of the output under autocast)
    bar = SQNR_DB["real_vs_emulated"]
    assert sqnr_db(outs[1], outs[0]) >= bar and sqnr_db(weight_grads[1], weight_grads[0]) >= bar


@pytest.mark.parametrize("capability", [(8, 0), (8, 6)])
def test_device_without_float8_gemms_is_refused_at_convert_time(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", None)
    with torch.device("meta"):  # built on meta, to be materialized on the GPU
        model = nn.Sequential(nn.Linear(32, 32))
    with pytest.raises(ValueError, match=r"emulate=True") as info:
        convert_to_float8_training(model, config=Float8LinearConfig())
    assert f"{capability[0]}.{capability[1]}" in str(info.value)
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    with torch.device("meta"):
        convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)), config=Float8LinearConfig())


def test_cpu_offload_with_float8_all_gather_is_refused():
    # Under CPUOffloadPolicy FSDP2 keeps the sharded weight on the CPU and calls the
    # pre-hook on a copy moved to the GPU; a meta copy stands in for the moved one here.
    layer = Float8Linear(32, 32, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    moved = layer.weight.to("meta")
    owner = SimpleNamespace(weight=SimpleNamespace(_local_tensor=layer.weight))
    with pytest.raises(ValueError, match="CPUOffloadPolicy"):
        moved.fsdp_pre_all_gather(None, torch.Size([32, 32]), (32, 1), owner, None)
