"""NVFP4Linear (fsdp_float8.nn.nvfp4_linear): its three GEMMs against a high-precision
nn.Linear, each GEMM against its definition built here from the numerics of
`fsdp_float8.core.nvfp4`, stochastic rounding's expectation, reproducibility, conversion,
state dicts, the refusals, and one quantization of the weight per version of its values.

SQNR floors (output, grad_input, grad_weight against float32 nn.Linear): measured on CPU
(torch 2.13) over seeds 0..31, x (4, 64, 256) randn, weight nn.Linear(256, 128)'s init,
grad_output randn, Hadamard transform and stochastic rounding on; each floor is
mean - 6 * std rounded down to 0.1 dB, the measured mean / std in the comment.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn

from fsdp_float8 import (
    Float8ConfigError,
    Float8LinearConfig,
    NVFP4Config,
    NVFP4Linear,
    convert_to_float8_training,
    high_precision_ends,
)
from fsdp_float8.core import nvfp4, nvfp4_gemm
from fsdp_float8.core.numerics import sqnr_db
from fsdp_float8.weight_wrappers.nvfp4 import NVFP4FSDPWeight, NVFP4Weight
from tests.models import Transformer, model_args

SQNR_FLOOR_DB = {
    "output": 16.4,  # 16.72 / 0.047
    "grad_input": 14.2,  # 14.55 / 0.044 (stochastic rounding of grad_output)
    "grad_weight": 14.6,  # 15.06 / 0.065
}


def _layer(seed: int = 0, **config) -> tuple[nn.Linear, NVFP4Linear]:
    torch.manual_seed(seed)
    hp = nn.Linear(256, 128, bias=False)
    layer = NVFP4Linear.from_float(hp, NVFP4Config(seed=seed, **config))
    layer.fqn = "layer"
    return hp, layer


def _grads(layer: nn.Module, x: torch.Tensor, go: torch.Tensor):
    x = x.detach().requires_grad_()
    y = layer(x)
    y.backward(go)
    grads = (y.detach(), x.grad, layer.weight.grad.clone())
    layer.weight.grad = None
    return grads


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sqnr_against_high_precision(seed: int) -> None:
    hp, layer = _layer(seed)
    g = torch.Generator().manual_seed(seed)
    x, go = torch.randn(4, 64, 256, generator=g), torch.randn(4, 64, 128, generator=g)
    ref, got = _grads(hp, x, go), _grads(layer, x, go)
    for name, a, b in zip(SQNR_FLOOR_DB, ref, got, strict=True):
        assert sqnr_db(a, b) >= SQNR_FLOOR_DB[name], (name, sqnr_db(a, b))


def _amax(t: torch.Tensor) -> torch.Tensor:
    return t.abs().amax().float()


def test_each_gemm_is_its_definition() -> None:
    """Rounding to nearest everywhere (stochastic rounding and Hadamard off): each GEMM is
    exactly the emulated GEMM of the operands quantized as the recipe says, the weight once
    in 16x16 tiles and transposed for grad_input; the token dim (24 rows) zero-padded."""
    _, layer = _layer(hadamard_grad_weight=False, stochastic_rounding=False)
    g = torch.Generator().manual_seed(7)
    x, go = torch.randn(24, 256, generator=g), torch.randn(24, 128, generator=g)
    out, gx, gw = _grads(layer, x, go)
    w = nvfp4.quantize(layer.weight.detach(), _amax(layer.weight), nvfp4.WEIGHT_BLOCK)
    act = nvfp4.ACTIVATION_BLOCK
    assert torch.equal(out, nvfp4_gemm.emulated_mm(nvfp4.quantize(x, _amax(x), act), w))
    qgo = nvfp4.quantize(go, _amax(go), act)
    assert torch.equal(gx, torch.mm(nvfp4.dequantize(qgo), nvfp4.dequantize(w)))
    go_t = torch.nn.functional.pad(go.t(), (0, 8))
    x_t = torch.nn.functional.pad(x.t(), (0, 8))
    q = [nvfp4.quantize(t, _amax(t), act) for t in (go_t, x_t)]
    assert torch.equal(gw, nvfp4_gemm.emulated_mm(*q))


def test_hadamard_changes_grad_weight_only_by_rounding() -> None:
    """With the transform the grad_weight GEMM sees other operands (SQNR against the
    untransformed one's result is finite) but the same product (both near high precision)."""
    hp, on = _layer(stochastic_rounding=False)
    _, off = _layer(stochastic_rounding=False, hadamard_grad_weight=False)
    g = torch.Generator().manual_seed(3)
    x, go = torch.randn(64, 256, generator=g), torch.randn(64, 128, generator=g)
    ref, a, b = _grads(hp, x, go), _grads(on, x, go), _grads(off, x, go)
    assert torch.equal(a[1], b[1]) and not torch.equal(a[2], b[2])
    assert sqnr_db(ref[2], a[2]) >= SQNR_FLOOR_DB["grad_weight"]


def test_stochastic_grad_input_is_unbiased_within_its_variance() -> None:
    """Over 256 seeds (each its own draws), the mean grad_input per element lies within 5
    standard errors (the sample std / sqrt(256)) of go @ W for the tile-quantized W: the
    rounding of grad_output is unbiased and the GEMM linear. 5 standard errors over 512
    elements: a false failure has odds about 3e-4 (and the draws are fixed by the seeds)."""
    torch.manual_seed(0)
    hp = nn.Linear(256, 128, bias=False)
    go = torch.randn(4, 128, generator=torch.Generator().manual_seed(5))
    x = torch.randn(4, 256)
    w = nvfp4.quantize(hp.weight.detach(), _amax(hp.weight), nvfp4.WEIGHT_BLOCK)
    exact = go @ nvfp4.dequantize(w)
    samples = []
    for seed in range(256):
        layer = NVFP4Linear.from_float(hp, NVFP4Config(seed=seed, hadamard_grad_weight=False))
        samples.append(_grads(layer, x, go)[1])
    s = torch.stack(samples)
    err = (s.mean(0) - exact).abs()
    bound = 5 * s.std(0) / 16 + 1e-6
    assert (err <= bound).all(), (err / bound).max()
    assert s.std(0).mean() > 0  # the seeds draw differently


def test_draws_are_the_same_under_compile_and_recompute() -> None:
    """The rounding draws hash the data, not a generator's state: a compiled layer
    (fullgraph, aot_eager) and an activation-checkpointed one give the eager gradients bit
    for bit."""
    from torch.utils.checkpoint import checkpoint

    g = torch.Generator().manual_seed(11)
    x, go = torch.randn(32, 256, generator=g), torch.randn(32, 128, generator=g)
    _, layer = _layer()
    eager = _grads(layer, x, go)
    compiled = _grads(torch.compile(layer, fullgraph=True, backend="aot_eager"), x, go)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))

    class _Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = layer.weight

        def forward(self, t):
            return checkpoint(layer, t, use_reentrant=False)

    recomputed = _grads(_Checkpointed(), x, go)
    assert all(torch.equal(a, b) for a, b in zip(eager, recomputed, strict=True))


def test_runs_are_reproducible_and_the_seed_matters() -> None:
    g = torch.Generator().manual_seed(9)
    x, go = torch.randn(32, 256, generator=g), torch.randn(32, 128, generator=g)
    a = _grads(_layer(0)[1], x, go)
    b = _grads(_layer(0)[1], x, go)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    _, other = _layer(0)
    other.config = NVFP4Config(seed=1)
    c = _grads(other, x, go)
    assert torch.equal(a[0], c[0]) and not torch.equal(a[1], c[1])


def test_convert_names_layers_and_high_precision_ends_keeps_the_ends() -> None:
    model = Transformer(model_args("tiny", dim=64, n_layers=4, n_heads=4, n_kv_heads=2))
    keep = high_precision_ends(model, first=1, last=1, blocks="blocks")
    convert_to_float8_training(model, config=NVFP4Config(), module_filter_fn=keep)
    converted = {n: m.fqn for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    assert converted and all(n == fqn for n, fqn in converted.items())
    assert {n.split(".")[1] for n in converted} == {"1", "2"}
    with pytest.raises(ValueError, match="no blocks named 'layers.<i>'"):
        high_precision_ends(model)
    with pytest.raises(ValueError, match="first=3, last=2"):
        high_precision_ends(model, first=3, last=2, blocks="blocks")


def test_high_precision_ends_keeps_the_ends_of_each_stack() -> None:
    def stack(n: int) -> nn.ModuleList:
        return nn.ModuleList(nn.Sequential(nn.Linear(32, 32)) for _ in range(n))

    model = nn.Module()
    model.encoder, model.decoder = nn.Module(), nn.Module()
    model.encoder.layers, model.decoder.layers = stack(3), stack(4)
    keep = high_precision_ends(model, first=1, last=1)
    kept = sorted(n for n, m in model.named_modules() if keep(m, n))
    assert kept == ["decoder.layers.1.0", "decoder.layers.2.0", "encoder.layers.1.0"], kept
    with pytest.raises(ValueError, match="first=2, last=2.* 3 blocks of the stack 'encoder'"):
        high_precision_ends(model, first=2, last=2)


def test_state_dict_is_plain_and_loads_back_into_the_wrapper(tmp_path) -> None:
    _, layer = _layer()
    layer = NVFP4Linear.from_float(
        nn.Linear(256, 128, bias=False), NVFP4Config(enable_fsdp_float8_all_gather=True)
    )
    assert isinstance(layer.weight.data, NVFP4FSDPWeight)
    sd = layer.state_dict()
    assert type(sd["weight"]) is torch.Tensor
    torch.save(layer.weight, tmp_path / "weight.pt")  # the wrapper and its config pickled
    back = torch.load(tmp_path / "weight.pt", weights_only=True)
    assert isinstance(back.data, NVFP4FSDPWeight) and back.data._config == layer.config
    assert torch.equal(back.detach(), layer.weight.detach())
    fresh = torch.zeros(128, 256)
    layer.load_state_dict({"weight": fresh}, assign=True)
    assert isinstance(layer.weight.data, NVFP4FSDPWeight)


def test_refusals() -> None:
    with pytest.raises(Float8ConfigError, match=r"multiples of 16.*\(40, 128\)"):
        NVFP4Linear(40, 128)
    with pytest.raises(Float8ConfigError, match="seed"):
        NVFP4Config(seed=-1)
    # a seed that no random feature reads would change nothing
    with pytest.raises(Float8ConfigError, match=r"seed=7\) .*hadamard_grad_weight") as info:
        NVFP4Config(seed=7, hadamard_grad_weight=False, stochastic_rounding=False)
    assert "seed=0" in str(info.value)
    assert NVFP4Config(hadamard_grad_weight=False, stochastic_rounding=False).seed == 0
    assert NVFP4Config(seed=7, hadamard_grad_weight=False).seed == 7
    with pytest.raises(Float8ConfigError, match="stochastic_rounding must be a bool"):
        NVFP4Config(stochastic_rounding=1)  # type: ignore[arg-type]
    _, layer = _layer()
    with pytest.raises(TypeError, match="torch.float64 but its weight is torch.float32"):
        layer(torch.randn(2, 256, dtype=torch.float64))
    record = nvfp4.quantize(torch.randn(32, 32), torch.tensor(4.0), nvfp4.WEIGHT_BLOCK)
    with pytest.raises(NotImplementedError, match="aten.add"):
        NVFP4Weight(record, torch.float32) + 1


def test_converting_again_and_experts() -> None:
    model = nn.Sequential(nn.Linear(64, 64))
    convert_to_float8_training(model, config=NVFP4Config())
    convert_to_float8_training(model, config=NVFP4Config())  # the same config: kept
    assert model.float8_conversion_report.skipped == {
        "0": "already a Float8Linear with this config"
    }
    with pytest.raises(Float8ConfigError, match="another config"):
        convert_to_float8_training(model, config=Float8LinearConfig())


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, 64, 32))
        self.w2 = nn.Parameter(torch.randn(4, 32, 64))
        self.w3 = nn.Parameter(torch.randn(4, 64, 32))


def test_experts_are_converted_unless_kept_out() -> None:
    model = nn.Module()
    model.experts = _Experts()
    convert_to_float8_training(model, config=NVFP4Config())
    assert model.float8_conversion_report.experts_converted == ["experts"]
    assert type(model.experts).__name__ == "NVFP4GroupedExperts"
    model = nn.Module()
    model.experts = _Experts()
    convert_to_float8_training(model, config=NVFP4Config(), expert_filter_fn=lambda m, n: False)
    assert model.float8_conversion_report.experts_skipped == {
        "experts": "rejected by expert_filter_fn"
    }


@pytest.mark.parametrize(
    "config",
    [{"stochastic_rounding": False, "hadamard_grad_weight": False}, {}],
    ids=["round_to_nearest", "default"],
)
def test_inductor_gives_the_eager_outputs_and_gradients_bit_for_bit(config) -> None:
    # bf16 with a bias: the quantize and the emulated GEMM are one op each, so inductor
    # neither fuses their rounding away nor splits their tile loops
    torch._dynamo.reset()
    torch.manual_seed(0)
    hp = nn.Linear(64, 32).to(torch.bfloat16)
    layer = NVFP4Linear.from_float(hp, NVFP4Config(**config))
    layer.fqn = "layer"
    g = torch.Generator().manual_seed(5)
    x = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    go = torch.randn(32, 32, generator=g).to(torch.bfloat16)
    eager = _grads(layer, x, go)
    compiled = _grads(torch.compile(layer, fullgraph=True, backend="inductor"), x, go)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))


def test_an_unsharded_weight_is_quantized_once_per_version() -> None:
    # forward and backward share one quantization of the weight; a layer called twice in a
    # step too; an in-place write (an optimizer step) makes a new version, quantized anew
    layer = NVFP4Linear.from_float(nn.Linear(64, 32, bias=False), NVFP4Config())
    real, count = nvfp4.quantize, [0]

    def quantize(x, amax, block=nvfp4.ACTIVATION_BLOCK, **kwargs):
        count[0] += block == nvfp4.WEIGHT_BLOCK
        return real(x, amax, block, **kwargs)

    x = torch.randn(3, 8, 64)
    with mock.patch.object(nvfp4, "quantize", quantize):
        layer(x[0]).sum().backward()
        assert count[0] == 1
        (layer(x[1]) + layer(x[2])).sum().backward()
        assert count[0] == 2
        with torch.no_grad():
            layer.weight.mul_(0.5)
        layer(x[1]).sum().backward()
        assert count[0] == 3
        # a write between two forwards: the second sees the new values (scaled by 2, the
        # codes and tile factors stay, the output doubles exactly)
        first = layer(x[0])  # its graph holds the quantized weight
        with torch.no_grad():
            layer.weight.mul_(2.0)
        second = layer(x[0])
        assert torch.equal(second, 2 * first) and count[0] == 5
    # the same weight after the write: the outputs of a fresh quantization
    fresh = NVFP4Linear.from_float(nn.Linear(64, 32, bias=False), NVFP4Config())
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(layer(x[2]), fresh(x[2]))


@pytest.mark.parametrize("shape", [(8, 256), (2, 4, 256)])
def test_output_takes_an_in_place_op_like_nn_linear(shape) -> None:
    # the output is no autograd view: an in-place residual add (`y += x`) runs as on
    # nn.Linear's output, and FSDP2 (which warns on view outputs, whose in-place ops would
    # bypass its pre-backward hook) sees a plain tensor
    _, layer = _layer(stochastic_rounding=False)
    x = torch.randn(shape)
    residual = torch.randn(*shape[:-1], 128)
    grads = []
    for in_place in (True, False):
        w = layer.weight
        w.grad = None
        xi = x.clone().requires_grad_()
        y = layer(xi)
        assert not y._is_view()
        if in_place:
            y += residual
        else:
            y = y + residual
        y.square().sum().backward()
        grads.append((xi.grad, w.grad))
    # the same gradients either way
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
