"""Switching from torchao.float8 is a change of import.

torchao's README example and a torchtitan-style converter sequence run unchanged with
`fsdp_float8` imports; configs take torchao's positional fields and resolve as torchao
resolves them; where torchao imports (an optional test dependency), the resolved configs of
both libraries agree field by field for every recipe, and the two libraries' emulated
layers give the same outputs and gradients. The FSDP2 version of the converter
sequence is in tests/distributed/test_torchao_dropin.py.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import warnings

import pytest
import torch
from torch import nn

from fsdp_float8 import (
    CastConfig,
    Float8GemmConfig,
    Float8Linear,
    Float8LinearConfig,
    Float8LinearRecipeName,
    ScalingGranularity,
    ScalingType,
    _auto_filter_for_recipe,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
    sqnr_db,
)
from fsdp_float8.core.config import E4M3, E5M2


def test_readme_example_runs_with_fsdp_float8_imports() -> None:
    # torchao's README example with `torchao.float8` -> `fsdp_float8`, sizes cut for CPU
    # (and no torch.compile, which costs minutes here; tests/unit/test_compile.py covers it)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 128)).bfloat16()
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    optimizer = torch.optim.SGD(m.parameters(), lr=0.1)

    def module_filter_fn(mod: torch.nn.Module, fqn: str):
        # don't convert the last module
        if fqn == "1":
            return False
        # don't convert linear modules with weight dimensions not divisible by 16
        if isinstance(mod, torch.nn.Linear):
            if mod.in_features % 16 != 0 or mod.out_features % 16 != 0:
                return False
        return True

    config = Float8LinearConfig.from_recipe_name("rowwise")
    convert_to_float8_training(m, config=config, module_filter_fn=module_filter_fn)
    assert type(m[0]) is Float8Linear and type(m[1]) is nn.Linear
    w0 = m[0].weight.detach().clone()
    for _ in range(3):
        optimizer.zero_grad()
        y = m(x)
        y.sum().backward()
        optimizer.step()
    assert torch.isfinite(m[0].weight).all() and not torch.equal(m[0].weight, w0)


def _torchtitan_converter(recipe_name, *, fsdp_all_gather: bool, filter_fqns: list[str]):
    """What torchtitan's float8 converter does, with fsdp_float8 imports: a config from a
    recipe name (or torchao's tensorwise flags), the auto filter, and whether to precompute."""
    if recipe_name is not None:
        config = Float8LinearConfig.from_recipe_name(recipe_name)
        precompute = False
    else:
        config = Float8LinearConfig(
            enable_fsdp_float8_all_gather=fsdp_all_gather,
            force_recompute_fp8_weight_in_bwd=False,
            emulate=False,
        )
        precompute = fsdp_all_gather
    filter_fn = _auto_filter_for_recipe(recipe_name or "tensorwise", filter_fqns=filter_fqns)
    return config, filter_fn, precompute


class _Net(nn.Module):
    """Linears the tensorwise auto filter keeps (out_features > 1024) and one it skips."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 1040)
        self.down = nn.Linear(1040, 64)  # K <= 4096 and N <= 1024: too small for float8
        self.output = nn.Linear(64, 1040)  # in filter_fqns

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(torch.relu(self.down(torch.relu(self.up(x)))))


def test_torchtitan_converter_sequence() -> None:
    torch.manual_seed(0)
    model = _Net()
    reference = _Net()
    reference.load_state_dict(model.state_dict())
    config, filter_fn, precompute = _torchtitan_converter(
        None, fsdp_all_gather=False, filter_fqns=["output"]
    )
    convert_to_float8_training(model, config=config, module_filter_fn=filter_fn)
    assert model.float8_conversion_report.converted == ["up"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    x = torch.randn(32, 64)
    for _ in range(5):
        for net, o in ((model, opt), (reference, ref_opt)):
            net(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
        if precompute:
            precompute_float8_dynamic_scale_for_fsdp(model)
    # float8 training follows the high-precision run (one converted layer; bound from the
    # linear output SQNR bar: 18 dB is an error below 13% of the signal)
    out, want = model(x), reference(x)
    assert (out - want).norm() < 0.13 * want.norm()


@pytest.mark.parametrize("recipe", list(Float8LinearRecipeName))
def test_from_recipe_name_takes_the_enum_or_its_value(recipe) -> None:
    assert Float8LinearConfig.from_recipe_name(recipe) == Float8LinearConfig.from_recipe_name(
        recipe.value
    )
    with pytest.raises(ValueError, match="expected a Float8LinearRecipeName or one of"):
        Float8LinearConfig.from_recipe_name("all_axiswise")


def test_auto_filter_follows_torchaos_thresholds() -> None:
    tw = _auto_filter_for_recipe(Float8LinearRecipeName.TENSORWISE, filter_fqns=["head"])
    assert tw(nn.Linear(64, 1040), "a") and tw(nn.Linear(8192, 64), "a")
    assert not tw(nn.Linear(4096, 1024), "a")  # K <= 4096 and N <= 1024
    assert not tw(nn.Linear(64, 1048), "a")  # not a multiple of 16
    assert not tw(nn.Linear(64, 1040), "model.head")  # fqn contains a filtered string
    assert not tw(nn.LayerNorm(1040), "a")
    rw = _auto_filter_for_recipe("rowwise", filter_fqns=[])
    assert rw(nn.Linear(4096, 8192), "a")
    assert not rw(nn.Linear(8192, 2048), "a")  # N <= 2048
    assert not rw(nn.Linear(1024, 8192), "a")  # K <= 1024
    assert not rw(nn.Linear(2048, 4096), "a")  # N <= 4096 and K <= 2048
    with pytest.raises(NotImplementedError, match="rowwise_with_gw_hp"):
        _auto_filter_for_recipe("rowwise_with_gw_hp", filter_fqns=[])


def test_positional_fields_in_torchaos_order() -> None:
    axis = CastConfig(ScalingType.DYNAMIC, ScalingGranularity.AXISWISE, E4M3)
    assert axis.scaling_granularity is ScalingGranularity.AXISWISE and axis.target_dtype == E4M3
    cfg = Float8LinearConfig(
        axis, None, axis, None, axis, None, Float8GemmConfig(True), Float8GemmConfig(False)
    )
    assert cfg == Float8LinearConfig.from_recipe_name("rowwise", round_scales_to_power_of_2=False)
    with pytest.raises(TypeError):  # the toolkit's own fields stay keyword-only
        CastConfig("static", "tensorwise", None, 2.0)


def test_for_grad_configs_and_target_dtypes_are_filled() -> None:
    cfg = Float8LinearConfig()
    assert cfg.cast_config_grad_output.target_dtype == E5M2
    assert cfg.cast_config_input.target_dtype == E4M3
    assert cfg.cast_config_input_for_grad_weight == cfg.cast_config_input
    assert cfg.cast_config_grad_output_for_grad_weight == cfg.cast_config_grad_output
    assert cfg.cast_config_weight_for_grad_input == cfg.cast_config_weight


def test_replace_derives_filled_fields_again() -> None:
    # a filled field is not frozen in by dataclasses.replace: the new primary config wins
    static = CastConfig(scaling_type="static", static_scale=448.0)
    cfg = dataclasses.replace(Float8LinearConfig(), cast_config_input=static)
    assert cfg.cast_config_input_for_grad_weight.static_scale == 448.0
    as_e5m2 = dataclasses.replace(cfg, cast_config_grad_output=cfg.cast_config_input)
    assert as_e5m2.cast_config_grad_output.target_dtype == E5M2  # its own default again
    explicit = CastConfig(target_dtype=E5M2)
    # emulated: a non-emulated e5m2 input meets e5m2 grad_output in grad_weight (refused)
    given = Float8LinearConfig(cast_config_input=explicit, emulate=True)
    kept = dataclasses.replace(given, pad_inner_dim=True)
    assert kept.cast_config_input.target_dtype == E5M2


def test_force_recompute_is_a_deprecated_no_op() -> None:
    with pytest.warns(FutureWarning, match="force_recompute_fp8_weight_in_bwd"):
        cfg = Float8LinearConfig(force_recompute_fp8_weight_in_bwd=True)
    torch.manual_seed(0)
    base = nn.Linear(64, 32)
    x = torch.randn(8, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        same = dataclasses.replace(cfg, force_recompute_fp8_weight_in_bwd=False)
    a = Float8Linear.from_float(base, cfg)(x)
    b = Float8Linear.from_float(base, same)(x)
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "build",
    [
        lambda: Float8LinearConfig(force_recompute_fp8_weight_in_bwd=True),
        lambda: Float8LinearConfig.from_recipe_name(
            "rowwise", force_recompute_fp8_weight_in_bwd=True
        ),
    ],
    ids=["constructor", "from_recipe_name"],
)
def test_force_recompute_warning_shows_under_pythons_default_filters(build) -> None:
    # torchao logs it unconditionally; Python's default filters hide a DeprecationWarning
    # raised outside __main__ (here: this test module, or fsdp_float8's from_recipe_name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("default")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=PendingDeprecationWarning)
        build()
    assert any("force_recompute_fp8_weight_in_bwd" in str(w.message) for w in caught)


def test_torchaos_keyword_names_are_accepted() -> None:
    # torchao names the model `module` in both functions
    model = nn.Sequential(nn.Linear(64, 32))
    model = convert_to_float8_training(module=model, config=Float8LinearConfig())
    assert isinstance(model[0], Float8Linear)
    precompute_float8_dynamic_scale_for_fsdp(module=model)


def test_float8_linear_has_torchaos_attributes() -> None:
    layer = Float8Linear.from_float(nn.Linear(64, 32), Float8LinearConfig.rowwise())
    # read by torchao's tensor-parallel styles
    assert layer.scaling_type_input is ScalingType.DYNAMIC
    assert layer.scaling_type_weight is ScalingType.DYNAMIC
    assert layer.scaling_type_grad_output is ScalingType.DYNAMIC
    assert layer.config.cast_config_input.target_dtype == E4M3
    assert layer.config.cast_config_grad_output.target_dtype == E4M3


def _fields(obj) -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            value = _fields(value)
        elif hasattr(value, "value") and hasattr(type(value), "__members__"):
            value = value.value  # an enum: compare by value across the two libraries
        out[f.name] = value
    return out


@pytest.mark.extras
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_resolved_configs_agree_with_torchao_field_by_field(recipe: str) -> None:
    ao = pytest.importorskip("torchao.float8")
    theirs = _fields(ao.Float8LinearConfig.from_recipe_name(recipe))
    ours = _fields(Float8LinearConfig.from_recipe_name(recipe))
    for name, value in theirs.items():
        if isinstance(value, dict):  # a cast or GEMM config: compare torchao's fields
            assert {k: ours[name][k] for k in value} == value, name
        else:
            assert ours[name] == value, name


@pytest.mark.extras
def test_field_order_agrees_with_torchao() -> None:
    ao = pytest.importorskip("torchao.float8")
    for theirs, ours in (
        (ao.CastConfig, CastConfig),
        (ao.Float8GemmConfig, Float8GemmConfig),
        (ao.Float8LinearConfig, Float8LinearConfig),
    ):
        names = [f.name for f in dataclasses.fields(theirs)]
        positional = [f.name for f in dataclasses.fields(ours) if not f.kw_only]
        assert positional == names, theirs.__name__
    # torchao's recipe names, in its order, then this package's block recipes
    theirs = [r.value for r in ao.Float8LinearRecipeName]
    assert [r.value for r in Float8LinearRecipeName][: len(theirs)] == theirs
    for name in ao.__all__:
        if name != "FP8Granularity":  # torchao's inference type alias
            assert hasattr(__import__("fsdp_float8"), name), name


@pytest.mark.extras
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_same_numerics_as_torchao_emulated(recipe: str) -> None:
    """Where torchao imports: the same model converted by both libraries gives the same
    output and gradients. Emulated GEMMs on both sides (float32 GEMMs of the dequantized
    float8 operands), so the float8 values must agree exactly and only the float32 summation
    order may differ: that is ~sqrt(K) * 2**-24 relative (~125 dB at K = 64; measured 135 dB
    to exact here), while a single float8 value cast differently costs far more (tens of
    dB). 100 dB separates the two."""
    ao = pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 48))
    x, grad_output = torch.randn(32, 64), torch.randn(32, 48)
    ao_config = dataclasses.replace(ao.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    configs = {
        "torchao": (ao.convert_to_float8_training, ao_config),
        "fsdp_float8": (
            convert_to_float8_training,
            Float8LinearConfig.from_recipe_name(recipe, emulate=True),
        ),
    }
    results = {}
    for name, (convert, config) in configs.items():
        model = copy.deepcopy(base)
        convert(model, config=config)
        xx = x.clone().requires_grad_(True)
        out = model(xx)
        out.backward(grad_output)
        results[name] = (out, xx.grad, model[0].weight.grad)
    for what, theirs, ours in zip(("output", "grad_input", "grad_weight"), *results.values()):
        assert sqnr_db(theirs, ours) >= 100, what


class _Kind(enum.Enum):  # another library's enums: the same values, not the same classes
    DYNAMIC = "dynamic"
    DISABLED = "disabled"


class _Grain(enum.Enum):
    TENSORWISE = "tensorwise"
    AXISWISE = "axiswise"


@dataclasses.dataclass(frozen=True)
class _OtherCast:
    scaling_type: _Kind = _Kind.DYNAMIC
    scaling_granularity: _Grain = _Grain.TENSORWISE
    target_dtype: torch.dtype | None = None


@dataclasses.dataclass(frozen=True)
class _OtherGemm:
    use_fast_accum: bool = False


@dataclasses.dataclass(frozen=True)
class _OtherConfig:
    """A config shaped like torchao.float8's Float8LinearConfig (its field names)."""

    cast_config_input: _OtherCast = _OtherCast()
    cast_config_weight: _OtherCast = _OtherCast()
    cast_config_grad_output: _OtherCast = _OtherCast()
    cast_config_weight_for_grad_input: _OtherCast | None = None
    gemm_config_output: _OtherGemm = _OtherGemm(True)
    enable_fsdp_float8_all_gather: bool = False
    round_scales_to_power_of_2: bool = False


def test_a_foreign_config_is_converted_field_by_field() -> None:
    axis = _OtherCast(_Kind.DYNAMIC, _Grain.AXISWISE, E4M3)
    rowwise = _OtherConfig(axis, axis, axis, round_scales_to_power_of_2=True)
    model = nn.Sequential(nn.Linear(64, 32))
    convert_to_float8_training(model, config=rowwise)
    assert type(model[0]) is Float8Linear
    assert model[0].config == Float8LinearConfig.from_recipe_name("rowwise")
    # a second use given equal to the first is the operand's own (filled as torchao fills it)
    tensorwise = _OtherConfig(cast_config_weight_for_grad_input=_OtherCast())
    assert Float8Linear.from_float(nn.Linear(64, 32), tensorwise).config == Float8LinearConfig()
    ours = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    assert (
        Float8Linear(64, 32, config=_OtherConfig(enable_fsdp_float8_all_gather=True)).config == ours
    )


def test_foreign_cast_and_gemm_configs_inside_ours_are_converted() -> None:
    # torchao's CastConfig / Float8GemmConfig given to fsdp_float8's Float8LinearConfig
    axis = _OtherCast(_Kind.DYNAMIC, _Grain.AXISWISE, E4M3)
    got = Float8LinearConfig(axis, None, axis, None, axis, gemm_config_output=_OtherGemm(False))
    want = Float8LinearConfig.from_recipe_name(
        "rowwise",
        gemm_config_output=Float8GemmConfig(use_fast_accum=False),
        round_scales_to_power_of_2=False,
    )
    assert got == want
    assert type(got.cast_config_input) is CastConfig


def test_a_foreign_config_we_cannot_honour_is_refused_by_name() -> None:
    @dataclasses.dataclass(frozen=True)
    class WithMore(_OtherConfig):
        use_new_kernel: bool = True

    with pytest.raises(ValueError, match=r"field use_new_kernel=True .*build an fsdp_float8"):
        convert_to_float8_training(nn.Sequential(nn.Linear(64, 32)), config=WithMore())

    @dataclasses.dataclass(frozen=True)
    class OtherBlocks:
        scaling_type: str = "dynamic"
        scaling_granularity: str = "tensorwise"
        target_dtype: torch.dtype | None = None
        block_size: int = 32

    with pytest.raises(ValueError, match=r"cast_config_input=.*unknown fields \['block_size'\]"):
        convert_to_float8_training(
            nn.Sequential(nn.Linear(64, 32)), config=_OtherConfig(OtherBlocks())
        )
    for bad in ("tensorwise", {"emulate": True}, Float8LinearConfig):
        with pytest.raises(TypeError, match=r"expected an fsdp_float8.Float8LinearConfig"):
            convert_to_float8_training(nn.Sequential(nn.Linear(64, 32)), config=bad)
    with pytest.raises(ValueError, match="expert_config"):
        convert_to_float8_training(nn.Sequential(nn.Linear(64, 32)), expert_config=WithMore())


@pytest.mark.extras
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_torchaos_config_converts_to_ours(recipe: str) -> None:
    ao = pytest.importorskip("torchao.float8")
    theirs = dataclasses.replace(ao.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    model = nn.Sequential(nn.Linear(64, 32))
    convert_to_float8_training(model, config=theirs)
    assert model[0].config == Float8LinearConfig.from_recipe_name(recipe, emulate=True)
    with_gather = ao.Float8LinearConfig(enable_fsdp_float8_all_gather=True, pad_inner_dim=True)
    assert Float8Linear(60, 40, config=with_gather).config == Float8LinearConfig(
        enable_fsdp_float8_all_gather=True, pad_inner_dim=True
    )


def test_auto_filter_takes_a_string_as_one_name() -> None:
    """A JSON or command-line override gives `filter_fqns="lm_head"`: one name, never its
    characters (which would filter every fqn holding an 'l', 'm', ...)."""
    as_string = _auto_filter_for_recipe("tensorwise", filter_fqns="lm_head")
    as_list = _auto_filter_for_recipe("tensorwise", filter_fqns=["lm_head"])
    layer = nn.Linear(64, 1040)
    for fqn, kept in (("layers.0.mlp", True), ("lm_head", False), ("output", True)):
        assert as_string(layer, fqn) is as_list(layer, fqn) is kept, fqn
    assert _auto_filter_for_recipe("tensorwise", filter_fqns=("a", "b"))(layer, "c")
    with pytest.raises(TypeError, match=r"filter_fqns=\['lm_head', 3\].*got 3 \(int\)"):
        _auto_filter_for_recipe("tensorwise", filter_fqns=["lm_head", 3])
    for bad in ("", [""], None, 3):  # an empty name would match every fqn
        with pytest.raises(TypeError, match="expected a list of non-empty strings"):
            _auto_filter_for_recipe("tensorwise", filter_fqns=bad)
