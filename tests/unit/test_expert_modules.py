"""The MoE module swap (fsdp_float8.experts.modules via convert_to_float8_training): a
small MoE block (torchtitan-style GroupedExperts), transformers 5.x fused experts (skipped
without transformers), what is converted and what is skipped with the reason."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fsdp_float8 import (
    DynamicFloat8Weight,
    Float8LinearConfig,
    convert_to_float8_training,
    sqnr_db,
)
from fsdp_float8.core.numerics import SQNR_DB
from fsdp_float8.experts.modules import Float8FusedExperts, Float8GroupedExperts
from tests.models import GroupedExperts, MoE, MoEArgs, Transformer, model_args

ROWWISE = Float8LinearConfig.from_recipe_name("rowwise", emulate=True)


def _moe_model(**moe):
    args = model_args("moe_tiny", n_layers=2, moe=MoEArgs(**{"hidden_dim": 128, **moe}))
    model = Transformer(args)
    model.init_weights(0)
    return model


@pytest.mark.parametrize("score_fn,shared", [("softmax", 128), ("sigmoid", 0)])
def test_own_moe_block_converts_its_experts(score_fn, shared):
    model = _moe_model(score_fn=score_fn, shared_expert_hidden_dim=shared)
    float8 = convert_to_float8_training(copy.deepcopy(model), config=ROWWISE)
    report = float8.float8_conversion_report
    assert report.experts_converted == [
        "blocks.0.feed_forward.experts",
        "blocks.1.feed_forward.experts",
    ]
    assert "float8: converted 2 expert modules" in str(report)
    assert isinstance(float8.blocks[0].feed_forward.experts, Float8GroupedExperts)
    assert isinstance(float8.blocks[0].feed_forward.router, nn.Parameter)  # stays hp
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    assert sqnr_db(model(tokens), float8(tokens)) >= SQNR_DB["linear_output"]


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "rowwise_with_gw_hp"])
def test_float8_grouped_experts_against_float64(recipe):
    """The SwiGLU experts (three grouped GEMMs chained) against float64, an empty expert."""
    g = torch.Generator().manual_seed(0)
    hp = GroupedExperts(64, 128, 4)
    for p in hp.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.05
    ref = copy.deepcopy(hp).double()
    config = Float8LinearConfig.from_recipe_name(recipe, emulate=True)
    float8 = Float8GroupedExperts.from_experts(hp, config)
    counts = torch.tensor([30, 0, 90, 8])
    x, go = torch.randn(128, 64, generator=g), torch.randn(128, 64, generator=g)
    x8, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    float8(x8, counts).backward(go)
    ref(x64, counts).backward(go.double())
    assert sqnr_db(ref(x64, counts), float8(x8, counts)) >= SQNR_DB["linear_output"]
    assert sqnr_db(x64.grad, x8.grad) >= SQNR_DB["linear_grad_input"]
    for name in ("w1", "w2", "w3"):
        got, want = getattr(float8, name).grad, getattr(ref, name).grad
        assert sqnr_db(want, got) >= SQNR_DB["linear_grad_weight"], name


def test_float8_experts_share_parameters_and_state_dict_keys():
    experts = GroupedExperts(64, 32, 4)
    float8 = Float8GroupedExperts.from_experts(experts, ROWWISE)
    assert float8.w1 is experts.w1 and float8.w2 is experts.w2
    assert float8.state_dict().keys() == experts.state_dict().keys()


class _Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts_weight = nn.Parameter(torch.zeros(4, 32, 32))


def test_unknown_3d_layout_and_refused_configs_are_reported():
    model = nn.ModuleDict({"odd": _Odd(), "moe": MoE(64, MoEArgs(n_experts=4, hidden_dim=24))})
    convert_to_float8_training(model, config=ROWWISE)
    skipped = model.float8_conversion_report.experts_skipped
    assert "no known expert layout" in skipped["odd"]
    assert "expert dims (24, 64) not multiples of 16" in skipped["moe.experts"]
    delayed = Float8LinearConfig.from_recipe_name("tensorwise", cast_config_weight=_delayed())
    model = nn.ModuleDict({"moe": MoE(64, MoEArgs(n_experts=4, hidden_dim=32))})
    convert_to_float8_training(model, config=delayed)
    assert "scale dynamically only" in model.float8_conversion_report.experts_skipped["moe.experts"]
    convert_to_float8_training(model, config=delayed, expert_config=ROWWISE)
    assert model.float8_conversion_report.experts_converted == ["moe.experts"]
    model = nn.ModuleDict({"moe": MoE(64, MoEArgs(n_experts=4, hidden_dim=128))})
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("blockwise"))
    assert "block-scaled" in model.float8_conversion_report.experts_skipped["moe.experts"]


def _delayed():
    from fsdp_float8 import CastConfig

    return CastConfig(scaling_type="delayed")


def test_expert_filter_fn_keeps_experts_out():
    model = _moe_model()
    convert_to_float8_training(model, config=ROWWISE, expert_filter_fn=lambda m, fqn: "0" in fqn)
    report = model.float8_conversion_report
    assert report.experts_converted == ["blocks.0.feed_forward.experts"]
    assert report.experts_skipped == {
        "blocks.1.feed_forward.experts": "rejected by expert_filter_fn"
    }


# -- transformers 5.x fused experts -------------------------------------------------------


def _hf_model(kind: str):
    transformers = pytest.importorskip("transformers", minversion="5.0")
    common = dict(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            intermediate_size=128, moe_intermediate_size=32, num_experts=8, **common
        )
        return transformers.Qwen3MoeForCausalLM(config)
    config = transformers.MixtralConfig(intermediate_size=32, num_local_experts=8, **common)
    return transformers.MixtralForCausalLM(config)


@pytest.mark.extras
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_transformers_fused_experts_convert(kind):
    model = _hf_model(kind)
    float8 = convert_to_float8_training(copy.deepcopy(model), config=ROWWISE)
    report = float8.float8_conversion_report
    assert report.experts_converted == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert not report.experts_skipped
    assert isinstance(float8.model.layers[0].mlp.experts, Float8FusedExperts)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    ref, out = model(tokens).logits, float8(tokens).logits
    assert sqnr_db(ref, out) >= SQNR_DB["linear_output"]


@pytest.mark.extras
def test_transformers_experts_with_biases_are_skipped_with_the_reason():
    model = _hf_model("qwen3_moe")
    model.model.layers[0].mlp.experts.has_bias = True
    convert_to_float8_training(model, config=ROWWISE)
    skipped = model.float8_conversion_report.experts_skipped
    assert list(skipped) == ["model.layers.0.mlp.experts"]
    assert "{'has_bias': True}" in skipped["model.layers.0.mlp.experts"]


@pytest.mark.extras
def test_fused_experts_drop_the_not_routed_marker():
    """transformers marks a slot routed to no local expert with index num_experts."""
    model = _hf_model("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    ref_experts = copy.deepcopy(experts)
    # the eager loop skips index num_experts; 5.18's default grouped_mm path does not
    ref_experts.config._experts_implementation = "eager"
    float8 = Float8FusedExperts.from_experts(experts, ROWWISE)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=g)
    index = torch.randint(0, 9, (64, 2), generator=g)  # 8: routed to no local expert
    index[2] = 8
    weights, go = torch.rand(64, 2, generator=g), torch.randn(64, 64, generator=g)
    ref, out = ref_experts(x, index, weights), float8(x, index, weights)
    assert torch.equal(out[2], torch.zeros(64))
    assert sqnr_db(ref, out) >= SQNR_DB["linear_output"]
    ref.backward(go)
    out.backward(go)
    for name in ("gate_up_proj", "down_proj"):
        want, got = getattr(ref_experts, name).grad, getattr(float8, name).grad
        assert sqnr_db(want, got) >= SQNR_DB["linear_grad_weight"], name


def test_float8_all_gather_experts_keep_plain_tensors_in_the_state_dict():
    config = Float8LinearConfig.from_recipe_name("rowwise", enable_fsdp_float8_all_gather=True)
    float8 = Float8GroupedExperts.from_experts(GroupedExperts(64, 32, 4), config)
    assert isinstance(float8.w1, DynamicFloat8Weight) and isinstance(float8.w1, nn.Parameter)
    state = float8.state_dict()
    assert all(type(v) is torch.Tensor for v in state.values()), {type(v) for v in state.values()}
    float8.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
    assert isinstance(float8.w2, DynamicFloat8Weight)  # re-wrapped after assign=True


# -- layouts faked without transformers ----------------------------------------------------


class _FusedExperts(nn.Module):
    """transformers 5.x fused experts' layout and forward signature (eager loop)."""

    def __init__(self, n: int = 8, hidden: int = 64, inter: int = 32):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(n, 2 * inter, hidden) / 8)
        self.down_proj = nn.Parameter(torch.randn(n, hidden, inter) / 8)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == e)
            gate, up = (hidden_states[token] @ self.gate_up_proj[e].T).chunk(2, dim=-1)
            y = (self.act_fn(gate) * up) @ self.down_proj[e].T
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out


class Llama4TextExperts(nn.Module):
    """transformers' Llama4TextExperts layout: weights (E, in, out), tokens pre-grouped."""

    def __init__(self, n: int = 4, hidden: int = 64, inter: int = 32):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(n, hidden, 2 * inter) / 8)
        self.down_proj = nn.Parameter(torch.randn(n, inter, hidden) / 8)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states):
        x = hidden_states.view(self.gate_up_proj.shape[0], -1, self.gate_up_proj.shape[1])
        gate, up = torch.bmm(x, self.gate_up_proj).chunk(2, dim=-1)
        return torch.bmm(up * self.act_fn(gate), self.down_proj).view(-1, x.shape[-1])


def test_llama4_transposed_experts_are_skipped_with_the_reason():
    """Transposed expert weights are no layout the float8 experts take: skipped, named, and
    the module runs as it was."""
    model = nn.ModuleDict({"experts": Llama4TextExperts()})
    convert_to_float8_training(model, config=ROWWISE)
    report = model.float8_conversion_report
    assert report.experts_converted == []
    why = report.experts_skipped["experts"]
    assert "Llama4TextExperts holds gate_up_proj (4, 64, 64) and down_proj (4, 32, 64)" in why
    assert "transposed weights" in why
    assert model["experts"](torch.randn(16, 64)).shape == (16, 64)  # runs, high precision


def test_fused_experts_forward_signature_is_checked():
    class OneArg(_FusedExperts):
        def forward(self, hidden_states):
            return hidden_states

    model = nn.ModuleDict({"experts": OneArg()})
    convert_to_float8_training(model, config=ROWWISE)
    why = model.float8_conversion_report.experts_skipped["experts"]
    assert "OneArg.forward(hidden_states) is not the fused experts' forward" in why


def test_fused_experts_refuse_an_out_of_range_expert_index():
    """Index num_experts is transformers' 'not routed here' marker; a larger one used to
    give zeros silently."""
    experts = _FusedExperts()
    model = nn.ModuleDict({"experts": experts})
    convert_to_float8_training(model, config=ROWWISE)
    assert model.float8_conversion_report.experts_converted == ["experts"]
    float8 = model["experts"]
    g = torch.Generator().manual_seed(0)
    x, weights = torch.randn(16, 64, generator=g), torch.rand(16, 2, generator=g)
    index = torch.randint(0, 8, (16, 2), generator=g)
    ref, out = experts(x, index, weights), float8(x, index, weights)
    assert sqnr_db(ref, out) >= SQNR_DB["linear_output"]
    index[3, 1] = 8  # the marker: dropped
    float8(x, index, weights)
    index[3, 1] = 9
    with pytest.raises(ValueError, match="top_k_index holds expert 9, but this experts module"):
        float8(x, index, weights)


def test_experts_the_config_cannot_convert_are_named_in_a_warning():
    # kept in high precision by the config, not by the user's choice: said, not only listed
    model = nn.ModuleDict({"moe": MoE(64, MoEArgs(n_experts=4, hidden_dim=128))})
    with pytest.warns(UserWarning, match=r"kept 1 experts module\(s\) in high precision") as got:
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("mxfp8"))
    message = str(got[0].message)
    assert "'moe.experts'" in message and "block-scaled" in message
    assert "expert_config=" in message and "expert_filter_fn" in message
    # the user's choice, an unknown 3-D layout, or a converted model: nothing to say
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = nn.ModuleDict({"moe": MoE(64, MoEArgs(n_experts=4, hidden_dim=128))})
        convert_to_float8_training(
            model,
            config=Float8LinearConfig.from_recipe_name("mxfp8"),
            expert_filter_fn=lambda m, fqn: False,
        )
        convert_to_float8_training(nn.ModuleDict({"odd": _Odd()}), config=ROWWISE)
        model = nn.ModuleDict({"moe": MoE(64, MoEArgs(n_experts=4, hidden_dim=128))})
        convert_to_float8_training(model, config=ROWWISE)
        convert_to_float8_training(model, config=ROWWISE)
