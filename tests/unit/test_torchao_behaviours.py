"""What code written for torchao.float8 relies on, beyond the names:

- config and conversion refusals are `Float8ConfigError`: the documented ValueError, and
  an AssertionError as torchao raises (its messages' key words too);
- a layer the user's own filter selects runs with any dims when emulated (float32 GEMMs
  take any shape); without emulation torch._scaled_mm's multiples of 16 are still required;
- repr in torchao's format (`cast_configs=i:dyn_ten_e4m3,...`);
- train then serve: a weight that another library quantized into its own tensor subclass
  (torchao's `quantize_(model, Float8WeightOnlyConfig())`) is used through F.linear;
- `Float8Linear` subclasses built with torchao's constructor (positional nn.Linear
  arguments, `config=` a torchao or fsdp_float8 config), as torchtitan builds them.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._pytree import tree_map

from fsdp_float8 import (
    CastConfig,
    Float8ConfigError,
    Float8Linear,
    Float8LinearConfig,
    convert_to_float8_training,
    sqnr_db,
)
from fsdp_float8.core.numerics import SQNR_DB
from tests.unit.test_torchao_compat import _OtherConfig


def test_contradictory_configs_raise_value_and_assertion_errors() -> None:
    with pytest.raises(AssertionError, match="incompatible operand precision for output"):
        Float8LinearConfig(
            cast_config_input=CastConfig(scaling_type="disabled"),
            cast_config_weight=CastConfig(scaling_type="dynamic"),
        )
    with pytest.raises(ValueError, match="incompatible operand precision for grad_input"):
        Float8LinearConfig(cast_config_grad_output=CastConfig(scaling_type="disabled"))
    with pytest.raises(Float8ConfigError, match="pad_inner_dim=True pads K and N"):
        Float8LinearConfig.from_recipe_name("blockwise", pad_inner_dim=True)
    assert issubclass(Float8ConfigError, ValueError) and issubclass(
        Float8ConfigError, AssertionError
    )


def test_a_root_linear_with_children_is_refused_as_torchao_refuses_it() -> None:
    root = nn.Linear(16, 16)
    root.child = nn.Sequential(nn.Linear(16, 16))
    for config in (Float8LinearConfig(), Float8LinearConfig(emulate=True)):
        with pytest.raises(AssertionError, match="Does not support a root nn.Linear with children"):
            convert_to_float8_training(root, config=config)
        with pytest.raises(ValueError, match=r"has \['child'\], which converting it would drop"):
            convert_to_float8_training(root, config=config)


class _MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(x)))


def test_the_users_filter_is_respected_with_any_dims_when_emulated() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_MLP(3), nn.Linear(3, 3), _MLP(3))
    reference = copy.deepcopy(model)
    skip = ("0.lin2", "2.lin1")
    convert = dict(module_filter_fn=lambda m, fqn: fqn not in skip)
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True), **convert)
    assert model.float8_conversion_report.converted == ["0.lin1", "1", "2.lin2"]
    assert type(model[0].lin2) is nn.Linear and type(model[2].lin2) is Float8Linear
    x = torch.randn(32, 3)
    model(x).sum().backward()
    reference(x).sum().backward()
    # three float8 layers in a row of five: each costs some SQNR; 3 dB a layer below the
    # one-layer bar (a layer's error adds at most its own noise power to the next)
    assert sqnr_db(reference(x), model(x)) >= SQNR_DB["linear_output"] - 3 * 3
    assert model[1].weight.grad is not None
    # not emulated: torch._scaled_mm needs multiples of 16, refused at conversion
    with pytest.raises(ValueError, match=r"Float8Linear\(3, 12\).*emulate=True runs any dims"):
        convert_to_float8_training(copy.deepcopy(reference), config=Float8LinearConfig(), **convert)
    # the default filter still skips such layers, emulated or not (as on the hardware)
    default = convert_to_float8_training(
        copy.deepcopy(reference), config=Float8LinearConfig(emulate=True)
    )
    assert default.float8_conversion_report.converted == []


def test_layers_the_default_filter_skips_are_named_in_a_warning() -> None:
    # torchao.float8 converts every linear (and fails at the GEMM); the default filter here
    # keeps the ones float8 GEMMs cannot take in high precision, and says so
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 12), nn.Linear(16, 32))
    with pytest.warns(UserWarning, match=r"'0' \(3, 3\), '1' \(3, 12\).*module_filter_fn"):
        convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
    assert model.float8_conversion_report.converted == ["2"]
    with pytest.warns(UserWarning, match=r"'' \(3, 3\)"):
        root = convert_to_float8_training(nn.Linear(3, 3), config=Float8LinearConfig())
    assert type(root) is nn.Linear
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped, nothing said
        convert_to_float8_training(nn.Sequential(nn.Linear(16, 32)), config=Float8LinearConfig())
        keep = dict(module_filter_fn=lambda m, fqn: fqn != "0")  # the user's own choice
        convert_to_float8_training(nn.Sequential(nn.Linear(3, 3)), **keep)


def test_repr_in_torchaos_format() -> None:
    layer = Float8Linear.from_float(nn.Linear(32, 16), Float8LinearConfig(emulate=True))
    assert repr(layer) == (
        "Float8Linear(in_features=32, out_features=16, bias=True, "
        "cast_configs=i:dyn_ten_e4m3,w:dyn_ten_e4m3,go:dyn_ten_e5m2)"
    )


class _Int8Weight(torch.Tensor):
    """Another library's quantized weight: int8 data and one scale, dequantized by any op."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.float32)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor) -> None:
        self.data_int8, self.scale = data, scale

    def __tensor_flatten__(self):
        return ["data_int8", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return _Int8Weight(inner["data_int8"], inner["scale"])

    def dequantize(self) -> torch.Tensor:
        return self.data_int8.float() * self.scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:  # nn.Parameter keeps the subclass
            return _Int8Weight(args[0].data_int8, args[0].scale)
        unwrap = lambda t: t.dequantize() if isinstance(t, _Int8Weight) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def test_a_weight_quantized_elsewhere_serves_through_its_own_gemm() -> None:
    torch.manual_seed(0)
    model = convert_to_float8_training(nn.Sequential(nn.Linear(64, 32)))
    x = torch.randn(8, 64)
    model(x).sum().backward()  # trained in float8
    w = model[0].weight.detach()
    scale = w.abs().max() / 127
    quantized = _Int8Weight((w / scale).round().to(torch.int8), scale)
    model[0].weight = nn.Parameter(quantized, requires_grad=False)  # what quantize_ does
    with torch.no_grad():
        out = model(x)
    want = F.linear(x, quantized.dequantize(), model[0].bias)
    assert torch.equal(out, want)  # its own GEMM, not a float8 re-cast (which differs)


def test_subclass_with_torchaos_constructor() -> None:
    class TitanFloat8Linear(Float8Linear):  # torchtitan's shape: a config object in, config=
        def __init__(self, spec: dict) -> None:
            Float8Linear.__init__(
                self, spec["in"], spec["out"], bias=spec["bias"], config=spec["float8"]
            )

    config = Float8LinearConfig.from_recipe_name("rowwise", emulate=True)
    layer = TitanFloat8Linear({"in": 64, "out": 32, "bias": False, "float8": config})
    assert layer.config == config and layer.bias is None and layer.weight.shape == (32, 64)
    layer(torch.randn(4, 64)).sum().backward()
    assert layer.weight.grad is not None
    # torchtitan hands it torchao's config object: converted field by field
    foreign = TitanFloat8Linear({"in": 64, "out": 32, "bias": True, "float8": _OtherConfig()})
    assert type(foreign) is TitanFloat8Linear and foreign.config == Float8LinearConfig()
    positional = Float8Linear(64, 32, False, None, torch.bfloat16, config=config)
    assert positional.weight.dtype == torch.bfloat16 and positional.bias is None
    built = Float8Linear.from_float(nn.Linear(64, 32), config=config)
    assert type(built) is Float8Linear and built.config == config


@pytest.mark.extras
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_repr_matches_torchaos(recipe: str) -> None:
    ao = pytest.importorskip("torchao.float8")
    config = ao.Float8LinearConfig.from_recipe_name(recipe)
    theirs = ao.float8_linear.Float8Linear.from_float(nn.Linear(32, 16), config=config)
    ours = Float8Linear.from_float(nn.Linear(32, 16), config=config)
    # torchao 0.18 ends its extra_repr with a stray '"'; the rest is the same text
    assert theirs.extra_repr().rstrip('"') == ours.extra_repr()


@pytest.mark.extras
def test_torchaos_train_to_serve_flow() -> None:
    """Train with fsdp_float8, then torchao's quantize_ for float8 weight-only serving."""
    quantization = pytest.importorskip("torchao.quantization")
    torch.manual_seed(0)
    model = convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)))
    x = torch.randn(32, 32)
    model(x).sum().backward()
    quantization.quantize_(model, quantization.Float8WeightOnlyConfig())
    weight = model[0].weight
    assert type(model[0]) is Float8Linear and weight.qdata.dtype == torch.float8_e4m3fn
    with torch.no_grad():
        out = model(x)
    torch.testing.assert_close(out, F.linear(x, weight.dequantize(), model[0].bias))
