"""Float8Telemetry on NVFP4Linear layers: each record (input, weight, grad_output) against
the NVFP4 cast computed directly with `nvfp4.quantize` / `dequantize` (underflow exact,
SQNR within float32 rounding of a float64 SQNR), an outlier weight whose tiles underflow
(the count derived from the two-level factors), sampling every N steps, and the FSDP2
NVFP4 all-gather weight compared row for row with each rank's shard."""

from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

from fsdp_float8 import convert_to_float8_training
from fsdp_float8.core import nvfp4
from fsdp_float8.core.numerics import sqnr_db
from fsdp_float8.core.randomized import rounding_draws
from fsdp_float8.nn.nvfp4_linear import NVFP4Config, NVFP4Linear, cast_stats
from fsdp_float8.tools.telemetry import RECORD_FIELDS, Float8NumericsWarning, Float8Telemetry
from fsdp_float8.weight_wrappers.nvfp4 import NVFP4Weight
from tests.distributed.launcher import cpu_mesh, run_distributed

DIM = 32
# |SQNR(float32 sums) - SQNR(float64)| in dB: relative norm errors of a few float32 ulps
# (~1e-6 over 1e3 elements) move 20 log10 by ~1e-5 dB; 1e-3 leaves room and still fails
# on any other cast (another block size or rounding moves the SQNR by > 0.1 dB)
SQNR_TOL_DB = 1e-3


def _model(config: NVFP4Config, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(
        OrderedDict(up=nn.Linear(DIM, DIM), act=nn.ReLU(), down=nn.Linear(DIM, 16, bias=False))
    )
    return convert_to_float8_training(model, config=config)


def _expected(hp: torch.Tensor, q: nvfp4.NVFP4) -> dict[str, float]:
    """The record's statistics of `q`, the NVFP4 cast of `hp`, computed here in float64."""
    hp64 = hp.detach().double()
    deq = nvfp4.dequantize(q).double()
    inv = q.block_inv_scale.double() * q.tensor_inv_scale.double()
    return {
        "amax": hp64.abs().max().item(),
        "scale": (1 / inv).min().item(),
        "scale_max": (1 / inv).max().item(),
        "underflow": ((hp64 != 0) & (deq == 0)).double().mean().item(),
        "sqnr": sqnr_db(hp64, deq),
    }


def _check(record: dict, expected: dict[str, float]) -> None:
    assert record["amax"] == pytest.approx(expected["amax"], rel=1e-6), record
    assert record["scale"] == pytest.approx(expected["scale"], rel=1e-6), record
    assert record["scale_max"] == pytest.approx(expected["scale_max"], rel=1e-6), record
    assert record["underflow"] == expected["underflow"], record
    assert abs(record["sqnr"] - expected["sqnr"]) < SQNR_TOL_DB, (record, expected)


def _keep_grad(seen: dict, fqn: str, out: torch.Tensor) -> None:
    """Keep the layer's grad_output (2-D) as `seen[(fqn, "grad_output")]`."""

    def keep(grad: torch.Tensor) -> None:
        seen[(fqn, "grad_output")] = grad.reshape(-1, grad.shape[-1])

    out.register_hook(keep)


@pytest.mark.parametrize("stochastic_rounding", [False, True])
def test_records_are_the_layers_casts(stochastic_rounding):
    config = NVFP4Config(stochastic_rounding=stochastic_rounding)
    model = _model(config)
    seen: dict[tuple[str, str], torch.Tensor] = {}
    for fqn in ("up", "down"):
        layer = getattr(model, fqn)
        layer.register_forward_pre_hook(
            lambda m, a, fqn=fqn: seen.__setitem__((fqn, "input"), a[0].reshape(-1, a[0].shape[-1]))
        )
        layer.register_forward_hook(lambda m, a, out, fqn=fqn: _keep_grad(seen, fqn, out))
    tel = Float8Telemetry(model, every=1, saturation_warn=None, underflow_warn=None)
    model(torch.randn(4, 8, DIM)).square().mean().backward()
    records = tel.flush()
    assert [tuple(r) for r in records] == [RECORD_FIELDS] * 6
    gemms = {"input": "output", "weight": "output", "grad_output": "grad_input"}
    for r in records:
        layer: NVFP4Linear = getattr(model, r["layer"])
        assert (r["float8_dtype"], r["gemm"]) == ("nvfp4", gemms[r["operand"]])
        assert r["saturation"] == 0.0  # dynamic amaxes: nothing beyond the e2m1 max
        if r["operand"] == "weight":
            hp = layer.weight.detach()
            q = nvfp4.quantize(hp, hp.abs().max(), nvfp4.WEIGHT_BLOCK)
        else:
            hp = seen[(r["layer"], r["operand"])]
            draws = None
            if r["operand"] == "grad_output" and stochastic_rounding:
                draws = rounding_draws(hp, layer.layer_seed, 0)  # the layer's own draws
            q = nvfp4.quantize(hp, hp.abs().max(), nvfp4.ACTIVATION_BLOCK, generator=draws)
        _check(r, _expected(hp, q))
        # 4-bit codes over 1x16 or 16x16 blocks of gaussian-like values: 15 to 25 dB
        assert 12.0 < r["sqnr"] < 30.0, r


def test_an_outlier_weight_underflows_outside_its_tile():
    """One element 1e8 x the amax m of the rest: the tensor factor is t = 1e8 m / (6 * 448);
    another tile's e4m3 factor (its amax / (6 t) < 2^-9) clamps to 2^-9, so values below a
    quarter of e2m1's 1 (half its smallest step 0.5) times 2^-9 t, i.e. below t / 2048 ~ 18 m,
    round to zero: all of them. In the outlier's own tile the factor is 448 and only the
    outlier survives. So every element but the outlier underflows, where the same weight
    without it underflows only its elements below a quarter step at their tile's scale
    (|x| < tile amax / 24: about a tenth of gaussian values)."""
    layer = NVFP4Linear(DIM, DIM, bias=False, config=NVFP4Config())
    model = nn.Sequential(OrderedDict(proj=layer))
    with torch.no_grad():
        layer.weight.copy_(torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(0)) * 0.1)
    x = torch.randn(8, DIM)

    def weight_record(warn):
        tel = Float8Telemetry(model, every=1, saturation_warn=None, underflow_warn=warn)
        model(x).sum().backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            (r,) = [r for r in tel.flush() if r["operand"] == "weight"]
        tel.remove()
        return r, [str(w.message) for w in caught if w.category is Float8NumericsWarning]

    healthy, quiet = weight_record(0.5)
    assert healthy["underflow"] < 0.2 and not [m for m in quiet if "(weight" in m]
    with torch.no_grad():
        layer.weight[3, 5] = 1e8 * layer.weight.abs().max()
    outlier, messages = weight_record(0.5)
    n = DIM * DIM
    assert outlier["underflow"] == (n - 1) / n, outlier
    assert any("nvfp4 underflow in proj (weight" in m for m in messages), messages
    hp = layer.weight.detach()
    _check(outlier, _expected(hp, nvfp4.quantize(hp, hp.abs().max(), nvfp4.WEIGHT_BLOCK)))


def test_samples_every_n_steps():
    model = _model(NVFP4Config())
    tel = Float8Telemetry(model, every=2)
    for step in range(5):
        assert bool(model.up._forward_pre_hooks) == (step % 2 == 0)
        model(torch.randn(2, 4, DIM)).square().mean().backward()
        tel.step()
    records = tel.flush()
    assert sorted({r["step"] for r in records}) == [0, 2, 4]
    assert len(records) == 3 * 2 * 3  # steps x layers x operands


def _fsdp2_nvfp4_all_gather_run(rank: int, world_size: int) -> dict:
    """On gloo ranks (`run_distributed`): two steps of a layer whose weight FSDP2 gathers in
    NVFP4, telemetry attached before fully_shard."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # the same weight on every rank
    model = nn.Sequential(OrderedDict(proj=nn.Linear(DIM, DIM, bias=False)))
    full = model.proj.weight.detach().clone()
    convert_to_float8_training(model, config=NVFP4Config(enable_fsdp_float8_all_gather=True))
    tel = Float8Telemetry(model, every=1, saturation_warn=None, underflow_warn=None)
    fully_shard(model, mesh=cpu_mesh(world_size))
    gathered = []
    model.proj.register_forward_pre_hook(
        lambda m, a: gathered.append(isinstance(m.weight, NVFP4Weight))
    )
    warned = []
    for step in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(
                torch.randn(8, DIM, generator=torch.Generator().manual_seed(step))
            ).sum().backward()
        warned.append(any("after fully_shard" in str(w.message) for w in caught))
        tel.step()
    weights = {r["step"]: r for r in tel.flush() if r["operand"] == "weight"}
    return {"gathered": gathered, "warned": warned, "weights": weights, "full": full}


def test_fsdp2_nvfp4_all_gather_weight_is_compared_with_each_ranks_shard(tmp_path):
    """Step 0 has no sharded weight yet (saturation, underflow and SQNR None, a warning);
    from step 1 each rank's record is its rows of the gathered weight (quantized with the
    whole weight's amax) against its shard: the statistics of those rows of the unsharded
    NVFP4 cast."""
    outs = run_distributed(_fsdp2_nvfp4_all_gather_run, 2, tmp_path)
    full = outs[0]["full"]
    q = nvfp4.quantize(full, full.abs().max(), nvfp4.WEIGHT_BLOCK)
    deq = nvfp4.dequantize(q)
    inv = q.block_inv_scale.float() * q.tensor_inv_scale
    for rank, out in enumerate(outs):
        assert torch.equal(out["full"], full)
        assert out["gathered"] == [True, True] and out["warned"] == [True, False]
        first, second = out["weights"][0], out["weights"][1]
        assert (first["saturation"], first["underflow"], first["sqnr"]) == (None, None, None)
        assert first["amax"] == pytest.approx(deq.abs().max().item(), rel=1e-6)
        rows = slice(rank * DIM // 2, (rank + 1) * DIM // 2)
        tiles = slice(rows.start // 16, rows.stop // 16)
        hp = full[rows]
        expected = {
            "amax": hp.abs().max().item(),
            "scale": (1 / inv[tiles]).min().item(),
            "scale_max": (1 / inv[tiles]).max().item(),
            "underflow": ((hp != 0) & (deq[rows] == 0)).double().mean().item(),
            "sqnr": sqnr_db(hp, deq[rows]),
        }
        _check(second, expected)
        assert second["saturation"] == 0.0


def test_an_empty_shard_has_nothing_to_report():
    """FSDP2 hands a rank with no rows an empty shard: zeros (no amax, nothing saturates or
    underflows) and an infinite SQNR (no error), read without raising."""
    full = torch.randn(16, DIM)
    q = nvfp4.quantize(full, full.abs().max(), nvfp4.WEIGHT_BLOCK)
    stats = cast_stats(full[16:], q, slice(16, 16))
    assert stats.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, float("inf")]
