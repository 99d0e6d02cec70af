"""convert_to_float8_training: the filter gets (module, fqn), the default filter skips dims
not divisible by 16 and says why, parameters are shared not copied."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import fsdp_float8
from fsdp_float8 import (
    CastConfig,
    Float8Linear,
    Float8LinearConfig,
    convert_to_float8_training,
    sqnr_db,
)
from fsdp_float8.core.numerics import SQNR_DB
from tests.models import Transformer, model_args


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 64),
        nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 20)),  # 20: not /16
        nn.Linear(20, 32),  # 20 in: not /16
        nn.LayerNorm(32),
    )


def _float8_fqns(model: nn.Module) -> list[str]:
    return [fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear)]


def test_filter_gets_module_and_fqn_and_is_obeyed() -> None:
    model = _model()
    linears = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    calls: list[tuple[nn.Module, str]] = []

    def keep_first_block(mod: nn.Module, fqn: str) -> bool:
        calls.append((mod, fqn))
        return fqn.startswith("1.")

    convert_to_float8_training(
        model, config=Float8LinearConfig(pad_inner_dim=True), module_filter_fn=keep_first_block
    )
    assert sorted(fqn for _, fqn in calls) == sorted(linears)
    assert all(mod is linears[fqn] for mod, fqn in calls)
    assert _float8_fqns(model) == ["1.0", "1.2"]
    report = model.float8_conversion_report
    assert report.converted == ["1.0", "1.2"]
    assert report.skipped == {
        "0": "rejected by module_filter_fn",
        "2": "rejected by module_filter_fn",
    }


def test_default_filter_skips_dims_not_divisible_by_16_and_reports_why() -> None:
    model = convert_to_float8_training(_model(), config=Float8LinearConfig())
    assert _float8_fqns(model) == ["0", "1.0"]
    report = model.float8_conversion_report
    assert set(report.skipped) == {"1.2", "2"}
    assert "dims (48, 20) not multiples of 16" in report.skipped["1.2"]
    assert "dims (20, 32)" in report.skipped["2"] and "pad_inner_dim=True" in report.skipped["2"]
    text = str(report)
    assert "converted 2 linear layers" in text and "skipped 2:" in text
    model(torch.randn(2, 3, 64)).sum().backward()  # the mixed model runs


def test_pad_inner_dim_converts_everything() -> None:
    model = convert_to_float8_training(_model(), config=Float8LinearConfig(pad_inner_dim=True))
    assert _float8_fqns(model) == ["0", "1.0", "1.2", "2"]
    assert model.float8_conversion_report.skipped == {}
    assert torch.isfinite(model(torch.randn(2, 3, 64))).all()


def test_parameters_are_shared_not_copied() -> None:
    model = _model()
    before = dict(model.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built before the swap
    convert_to_float8_training(model, config=Float8LinearConfig())
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)
    w0 = model[0].weight.detach().clone()
    model(torch.randn(4, 64)).square().sum().backward()
    optimizer.step()  # the optimizer still owns the converted layer's weight
    assert not torch.equal(model[0].weight, w0)


def test_converted_outputs_match_the_original() -> None:
    model = _model()
    x = torch.randn(2, 5, 64)
    want = model(x)
    got = convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))(x)
    assert want.shape == got.shape and not torch.equal(want, got)  # float8 really ran
    # the field's bar for a float8 linear output (32 dB measured); the old atol=0.1 sat
    # just above a measured max error of 0.086
    assert sqnr_db(want, got) >= SQNR_DB["linear_output"]


def test_root_linear_is_converted_and_returned() -> None:
    linear = nn.Linear(64, 32)
    new = convert_to_float8_training(linear, config=Float8LinearConfig())
    assert isinstance(new, Float8Linear) and new.weight is linear.weight
    assert new.float8_conversion_report.converted == [""]
    kept = convert_to_float8_training(nn.Linear(64, 32), module_filter_fn=lambda m, fqn: False)
    assert type(kept) is nn.Linear and kept.float8_conversion_report.skipped == {
        "": "rejected by module_filter_fn"
    }


def test_repeat_conversion_with_the_same_config_leaves_layers_alone() -> None:
    model = convert_to_float8_training(_model())
    layer = model[0]
    convert_to_float8_training(model)
    assert model[0] is layer and _float8_fqns(model) == ["0", "1.0"]
    assert model.float8_conversion_report.converted == []
    assert model.float8_conversion_report.skipped["0"] == "already a Float8Linear with this config"


def test_repeat_conversion_with_another_recipe_raises_naming_the_existing_config() -> None:
    model = convert_to_float8_training(_model(), config=Float8LinearConfig.tensorwise())
    with pytest.raises(ValueError, match="0 is already a Float8Linear with another config") as e:
        convert_to_float8_training(model, config=Float8LinearConfig.rowwise())
    assert "i:dyn_ten_e4m3" in str(e.value) and "Convert the original" in str(e.value)
    assert model[0].config == Float8LinearConfig.tensorwise()  # nothing changed


def test_a_config_with_every_cast_disabled_is_refused() -> None:
    off = CastConfig(scaling_type="disabled")
    config = Float8LinearConfig(
        cast_config_input=off, cast_config_weight=off, cast_config_grad_output=off
    )
    model = _model()
    with pytest.raises(ValueError, match="every cast of this Float8LinearConfig is disabled"):
        convert_to_float8_training(model, config=config)
    assert _float8_fqns(model) == []


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.body = nn.Linear(32, 32)
        self.head = nn.Linear(32, 20)  # not /16: the default filter skips it
        self.out = nn.Linear(32, 64, bias=False)
        self.out.weight = self.emb.weight


@pytest.mark.parametrize("user_filter", [False, True])
def test_tied_weight_refusal_remedy_works_when_followed(user_filter: bool) -> None:
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    first = (lambda m, fqn: fqn != "head") if user_filter else None
    with pytest.raises(
        ValueError, match=r"out.weight is tied to \['emb.weight', 'out.weight'\]"
    ) as e:
        convert_to_float8_training(_Tied(), config=config, module_filter_fn=first)
    message = str(e.value)
    if user_filter:
        assert "your module_filter_fn also returning False for 'out'" in message
        remedy = lambda m, fqn: fqn not in ("head", "out")  # what the message asks for
    else:  # the message spells the filter out: use it as written
        code = re.search(r"`module_filter_fn=(.*?)`", message).group(1)
        remedy = eval(code, {"fsdp_float8": fsdp_float8})
    model = convert_to_float8_training(_Tied(), config=config, module_filter_fn=remedy)
    assert _float8_fqns(model) == ["body"]
    model.out(model.emb(torch.tensor([[1, 2]]))).sum().backward()


def test_tied_linears_refused_with_float8_all_gather_until_both_are_filtered() -> None:
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    model[1].weight = model[0].weight
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    with pytest.raises(ValueError, match="is tied to") as info:
        convert_to_float8_training(model, config=config)
    code = re.search(r"`module_filter_fn=(.*?)`", str(info.value)).group(1)
    assert "fqn not in ('0', '1')" in code
    convert_to_float8_training(
        model, config=config, module_filter_fn=eval(code, {"fsdp_float8": fsdp_float8})
    )
    assert _float8_fqns(model) == []


def test_transformer_conversion_skipping_the_output_head() -> None:
    args = model_args("tiny", n_layers=2, dim=64, multiple_of=64)
    model = Transformer(args)
    convert_to_float8_training(
        model, config=Float8LinearConfig(), module_filter_fn=lambda mod, fqn: fqn != "output"
    )
    linears_per_block = 7  # wq wk wv wo w1 w2 w3
    assert len(model.float8_conversion_report.converted) == 2 * linears_per_block
    assert model.float8_conversion_report.skipped == {"output": "rejected by module_filter_fn"}
    assert type(model.output) is nn.Linear


class _Aliased(nn.Module):
    """One block list under two attribute names, and one layer under two parents."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
        self.layers = self.blocks  # the same modules, another name
        shared = nn.Linear(64, 64)
        self.a, self.b = nn.Sequential(shared), nn.Sequential(shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(self.layers[1](self.blocks[0](x))))


@pytest.mark.parametrize("all_gather", [False, True])
def test_a_module_under_two_names_is_converted_once_not_refused_as_tied(all_gather) -> None:
    model = _Aliased()
    x, shared_weight = torch.randn(4, 64), model.a[0].weight
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather)
    convert_to_float8_training(model, config=config)
    assert model.float8_conversion_report.converted == ["blocks.0", "blocks.1", "a.0"]
    assert model.layers is model.blocks and model.a[0] is model.b[0]
    assert all(type(m) is Float8Linear for m in (*model.blocks, model.a[0]))
    model(x).sum().backward()  # each weight once: an optimizer sees 3 weights and 3 biases
    assert len(list(model.parameters())) == 6 and model.a[0].weight.grad is not None
    if not all_gather:  # shared, not copied
        assert model.a[0].weight is shared_weight
