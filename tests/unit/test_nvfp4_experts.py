"""NVFP4 experts (fsdp_float8.experts.nvfp4_experts): the three GEMMs of a grouped expert
projection against float64, the grouped GEMMs against NVFP4Linear run per expert (bit for
bit), the transformers fused layout, conversion, the per-expert weight quantization, the
refusals, state dicts.

SQNR floors (output, grad_input, grad_weight of `grouped(x, "w1", offs)` against float64
per-expert GEMMs): measured on CPU (torch 2.13) over seeds 0..31, E=4 experts with w1
(4, 128, 256) ~ N(0, 1/256), x (256, 256) randn grouped 80 / 0 / 112 / 64 tokens,
grad_output randn, Hadamard transform and stochastic rounding on (grad_weight over the
experts that have tokens); each floor is mean - 6 * std rounded down to 0.1 dB, the
measured mean / std in the comment.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fsdp_float8 import (
    Float8ConfigError,
    Float8GroupedExperts,
    Float8LinearConfig,
    NVFP4Config,
    NVFP4FusedExperts,
    NVFP4GroupedExperts,
    NVFP4Linear,
    convert_to_float8_training,
    sqnr_db,
)
from fsdp_float8.core import nvfp4
from fsdp_float8.experts.modules import permute_by_expert
from fsdp_float8.experts.nvfp4_experts import NVFP4ExpertsFSDPWeight
from tests.models import GroupedExperts, MoEArgs, Transformer, model_args

SQNR_FLOOR_DB = {
    "output": 18.4,  # 18.77 / 0.051
    "grad_input": 14.2,  # 14.61 / 0.053 (stochastic rounding of grad_output)
    "grad_weight": 14.7,  # 15.05 / 0.042
}
E, DIM, HID = 4, 256, 128
COUNTS = [80, 0, 112, 64]  # one expert without tokens


def _experts(seed: int = 0, **config) -> tuple[GroupedExperts, NVFP4GroupedExperts]:
    torch.manual_seed(seed)
    src = GroupedExperts(DIM, HID, E)
    for p in src.parameters():
        nn.init.normal_(p, std=DIM**-0.5)
    module = NVFP4GroupedExperts.from_experts(src, NVFP4Config(seed=seed, **config))
    module.fqn = "experts"
    return src, module


def _offs(counts=COUNTS) -> torch.Tensor:
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32)


def _inputs(seed: int, out: int = HID, inp: int = DIM):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(COUNTS), inp, generator=g), torch.randn(sum(COUNTS), out, generator=g)


def _grouped_grads(module: NVFP4GroupedExperts, name: str, x, go):
    x = x.detach().requires_grad_()
    y = module.grouped(x, name, _offs())
    y.backward(go)
    weight = getattr(module, name)
    grads = (y.detach(), x.grad, weight.grad.clone())
    weight.grad = None
    return grads


def _reference(w: torch.Tensor, x: torch.Tensor, go: torch.Tensor):
    """float64 per-expert GEMMs: output, grad_input, grad_weight."""
    w, x, go = w.detach().double(), x.double(), go.double()
    y, gx = go.new_zeros(x.shape[0], w.shape[1]), torch.zeros_like(x)
    gw = torch.zeros_like(w)
    s = 0
    for e, c in enumerate(COUNTS):
        y[s : s + c] = x[s : s + c] @ w[e].T
        gx[s : s + c] = go[s : s + c] @ w[e]
        gw[e] = go[s : s + c].T @ x[s : s + c]
        s += c
    return y, gx, gw


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sqnr_of_each_grouped_gemm_against_float64(seed: int) -> None:
    src, module = _experts(seed)
    x, go = _inputs(seed)
    got = _grouped_grads(module, "w1", x, go)
    ref = _reference(src.w1, x, go)
    routed = [e for e, c in enumerate(COUNTS) if c]
    assert torch.equal(got[2][1], torch.zeros(HID, DIM))  # no tokens: no gradient
    for name, a, b in zip(SQNR_FLOOR_DB, ref, got, strict=True):
        if name == "grad_weight":
            a, b = a[routed], b[routed]
        assert sqnr_db(a, b.double()) >= SQNR_FLOOR_DB[name], (name, sqnr_db(a, b.double()))


CONFIGS = {
    "default": {},
    "round_to_nearest": {"stochastic_rounding": False, "hadamard_grad_weight": False},
    "four_over_six": {"four_over_six": True},
}


@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_grouped_gemms_equal_nvfp4_linear_per_expert(config) -> None:
    """Expert e of weight `w2` on its token rows is the NVFP4Linear named
    `experts.w2.<e>`: the same quantization, draws and Hadamard signs, bit for bit."""
    _, module = _experts(**config)
    x, go = _inputs(5, out=DIM, inp=HID)
    out, gx, gw = _grouped_grads(module, "w2", x, go)
    s = 0
    for e, c in enumerate(COUNTS):
        linear = nn.Linear(HID, DIM, bias=False)
        linear.weight = nn.Parameter(module.w2.detach()[e].clone())
        layer = NVFP4Linear.from_float(linear, NVFP4Config(seed=0, **config))
        layer.fqn = f"experts.w2.{e}"
        if c == 0:
            assert torch.equal(gw[e], torch.zeros(DIM, HID))
            continue
        xe = x[s : s + c].clone().requires_grad_()
        ye = layer(xe)
        ye.backward(go[s : s + c])
        assert torch.equal(out[s : s + c], ye), e
        assert torch.equal(gx[s : s + c], xe.grad), e
        assert torch.equal(gw[e], layer.weight.grad), e
        s += c


def test_each_expert_is_quantized_with_its_own_amax() -> None:
    w = torch.randn(3, 32, 64) * torch.tensor([1.0, 100.0, 0.01])[:, None, None]
    q = nvfp4.quantize_per_matrix(w)
    assert q.tensor_inv_scale.shape == (3,)
    for e in range(3):
        alone = nvfp4.quantize(w[e], w[e].abs().amax(), nvfp4.WEIGHT_BLOCK)
        part = nvfp4.matrix(q, e)
        assert torch.equal(part.packed, alone.packed)
        assert torch.equal(
            part.block_inv_scale.view(torch.uint8), alone.block_inv_scale.view(torch.uint8)
        )
        assert torch.equal(part.tensor_inv_scale, alone.tensor_inv_scale)
    # a shard of whole experts quantizes as the whole does
    shard = nvfp4.quantize_per_matrix(w[1:])
    assert torch.equal(shard.packed, q.packed[1:])
    with pytest.raises(ValueError, match=r"stack of matrices \(E, R, C\), got shape \(32, 64\)"):
        nvfp4.quantize_per_matrix(w[0])


def _moe_model() -> Transformer:
    moe = MoEArgs(n_experts=4, top_k=2, hidden_dim=32)
    model = Transformer(model_args("moe_tiny", dim=64, n_layers=2, n_heads=4, moe=moe))
    model.init_weights(0)
    return model


def test_conversion_picks_nvfp4_experts_and_respects_the_filter() -> None:
    model = convert_to_float8_training(_moe_model(), config=NVFP4Config())
    report = model.float8_conversion_report
    names = ["blocks.0.feed_forward.experts", "blocks.1.feed_forward.experts"]
    assert report.experts_converted == names
    experts = model.get_submodule(names[0])
    assert type(experts) is NVFP4GroupedExperts and experts.fqn == names[0]
    loss = model(torch.randint(0, 256, (2, 9))).float().pow(2).mean()
    loss.backward()
    assert experts.w1.grad is not None and experts.w1.grad.abs().sum() > 0
    kept = convert_to_float8_training(
        _moe_model(),
        config=NVFP4Config(),
        expert_filter_fn=lambda m, fqn: not fqn.startswith("blocks.1."),
    )
    assert kept.float8_conversion_report.experts_skipped == {
        names[1]: "rejected by expert_filter_fn"
    }
    assert type(kept.get_submodule(names[1])) is not NVFP4GroupedExperts
    # a float8 expert_config still gives float8 experts next to NVFP4 linears
    mixed = convert_to_float8_training(
        _moe_model(),
        config=NVFP4Config(),
        expert_config=Float8LinearConfig.from_recipe_name("rowwise", emulate=True),
    )
    assert type(mixed.get_submodule(names[0])) is Float8GroupedExperts
    # and an NVFP4 expert_config NVFP4 experts next to float8 linears
    nv = convert_to_float8_training(
        _moe_model(), config=Float8LinearConfig(emulate=True), expert_config=NVFP4Config()
    )
    assert type(nv.get_submodule(names[0])) is NVFP4GroupedExperts


class _Experts(nn.Module):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, hidden, 64))
        self.w2 = nn.Parameter(torch.randn(4, 64, hidden))
        self.w3 = nn.Parameter(torch.randn(4, hidden, 64))


def test_dims_not_multiples_of_16_are_skipped_or_refused() -> None:
    model = nn.Module()
    model.experts = _Experts(hidden=40)
    convert_to_float8_training(model, config=NVFP4Config())
    why = model.float8_conversion_report.experts_skipped["experts"]
    assert "(40, 64) not multiples of 16" in why, why
    with pytest.raises(Float8ConfigError) as err:
        NVFP4GroupedExperts.from_experts(_Experts(hidden=40), NVFP4Config())
    text = str(err.value)
    assert "w1 (4, 40, 64)" in text and "multiples of 16" in text, text
    assert "expert_filter_fn" in text, text  # the remedy
    with pytest.raises(TypeError, match="must be an NVFP4Config"):
        NVFP4GroupedExperts.from_experts(_Experts(), Float8LinearConfig())


def test_state_dict_is_plain_and_the_weights_stay_wrapped() -> None:
    model = nn.Module()
    model.experts = _Experts()
    convert_to_float8_training(model, config=NVFP4Config(enable_fsdp_float8_all_gather=True))
    assert isinstance(model.experts.w1, NVFP4ExpertsFSDPWeight)
    sd = model.state_dict()
    assert all(type(t) is torch.Tensor for t in sd.values()), {k: type(t) for k, t in sd.items()}
    model.load_state_dict({k: v.clone() + 1 for k, v in sd.items()}, assign=True)
    assert isinstance(model.experts.w1, NVFP4ExpertsFSDPWeight)
    x = torch.randn(20, 64)
    y = model.experts(x, torch.tensor([5, 5, 0, 10]))
    assert y.shape == (20, 64) and torch.isfinite(y).all()


class _FusedExperts(nn.Module):
    """transformers 5.x fused experts, as Qwen3MoeExperts lays them out."""

    def __init__(self, n: int = 4, hidden: int = 64, inter: int = 32) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(n, 2 * inter, hidden) * hidden**-0.5)
        self.down_proj = nn.Parameter(torch.randn(n, hidden, inter) * inter**-0.5)
        self.act_fn = F.silu

    def forward(self, hidden_states, top_k_index, top_k_weights):
        raise NotImplementedError  # replaced by conversion


def test_fused_layout_equals_nvfp4_linears_per_expert() -> None:
    model = nn.Module()
    model.experts = _FusedExperts()
    config = NVFP4Config()
    convert_to_float8_training(model, config=config)
    experts = model.experts
    assert type(experts) is NVFP4FusedExperts
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(24, 64, generator=g)
    top_k = torch.randint(0, 4, (24, 2), generator=g)
    weights = torch.rand(24, 2, generator=g)
    out = experts(hidden, top_k, weights)
    x, offs, token_of, order = permute_by_expert(hidden, top_k, 4)
    rows = torch.zeros(x.shape[0], 64)
    bounds = [0, *offs.tolist()]
    for e in range(4):
        s, t = bounds[e], bounds[e + 1]
        layers = {}
        for name, w in (("gate_up_proj", experts.gate_up_proj), ("down_proj", experts.down_proj)):
            linear = nn.Linear(w.shape[2], w.shape[1], bias=False)
            linear.weight = nn.Parameter(w.detach()[e].clone())
            layers[name] = NVFP4Linear.from_float(linear, config)
            layers[name].fqn = f"experts.{name}.{e}"
        if t > s:
            gate, up = layers["gate_up_proj"](x[s:t]).chunk(2, dim=-1)
            rows[s:t] = layers["down_proj"](F.silu(gate) * up)
    rows = rows * weights.reshape(-1)[order, None]
    expected = torch.zeros_like(hidden).index_add_(0, token_of, rows)
    assert torch.equal(out, expected)


def test_autocast_runs_the_gemms_in_its_dtype_and_a_mismatch_is_refused() -> None:
    _, module = _experts()
    x = torch.randn(sum(COUNTS), DIM, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = module.grouped(x, "w1", _offs())
    assert y.dtype == torch.bfloat16
    y.float().pow(2).sum().backward()
    assert x.grad.dtype == torch.float32 and module.w1.grad.dtype == torch.float32
    with pytest.raises(TypeError, match=r"input has dtype torch.bfloat16 but w1 is torch.float32"):
        module.grouped(x.detach().bfloat16(), "w1", _offs())
