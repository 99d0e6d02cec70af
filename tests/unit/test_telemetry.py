"""Float8Telemetry: exact saturation/underflow counts on constructed tensors, sampling every N
steps without launching anything on the other steps, warnings that name the layer, the
tensorwise / rowwise / delayed recipes on a converted model (delayed state untouched), the
FSDP2 float8 all-gather weight path on one in-process rank."""

from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fsdp_float8 import (
    CastConfig,
    Float8Linear,
    Float8LinearConfig,
    Float8Tensor,
    convert_to_float8_training,
    sync_float8_amax_and_scale_history,
)
from fsdp_float8.core.config import E4M3
from fsdp_float8.core.gemms import CONTRACTION_DIM, Gemm, Operand
from fsdp_float8.core.numerics import float8_rounding_max, out_of_range_fraction, underflow_fraction
from fsdp_float8.core.scaling import amax_to_scale
from fsdp_float8.tools import telemetry as telemetry_mod
from fsdp_float8.tools.telemetry import (
    RECORD_FIELDS,
    Float8NumericsWarning,
    Float8Telemetry,
)
from tests.distributed.launcher import cpu_mesh, run_distributed
from tests.unit.float8_helpers import OpLog

DIM = 16
# Below half the smallest subnormal, so they round to zero: e4m3fn 2^-9, e5m2 2^-16.
TINY = {"input": 1e-4, "weight": 1e-5, "grad_output": 1e-6}
# Above the float8 max at scale 1: e4m3fn 448, e5m2 57344.
HUGE = {"input": 1000.0, "weight": -600.0, "grad_output": 1e5}
# Above the float8 max but within rounding of it (max + half a float8 step): clamped by no
# more than rounding would move them, so they do not count as saturating.
NEAR = {"input": 460.0, "weight": -450.0, "grad_output": 60000.0}
# (saturating, underflowing, exact zeros, near max) per operand; zeros and near-max must not
# count.
COUNTS = {"input": (3, 5, 4, 2), "weight": (2, 7, 3, 1), "grad_output": (4, 6, 2, 3)}


def _static_config(scale: float = 1.0) -> Float8LinearConfig:
    static = CastConfig(scaling_type="static", static_scale=scale)
    return Float8LinearConfig(
        cast_config_input=static, cast_config_weight=static, cast_config_grad_output=static
    )


def _known(operand: str, shape: tuple[int, int], fill: float) -> torch.Tensor:
    """`fill` everywhere except known numbers of huge, tiny, zero and near-max elements."""
    flat = torch.full((shape[0] * shape[1],), fill)
    start = 0
    for n, value in zip(COUNTS[operand], (HUGE, TINY, 0.0, NEAR)):
        flat[start : start + n] = value[operand] if isinstance(value, dict) else value
        start += n
    return flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))].view(
        shape
    )


def _model(config: Float8LinearConfig, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(
        OrderedDict(up=nn.Linear(32, 32), act=nn.ReLU(), down=nn.Linear(32, DIM, bias=False))
    )
    return convert_to_float8_training(model, config=config)


def _train_step(model: nn.Module, seed: int, sync: bool = False) -> None:
    torch.manual_seed(1000 + seed)
    model(torch.randn(2, 4, 32)).square().mean().backward()
    if sync:
        sync_float8_amax_and_scale_history(model)


def _by_key(records):
    return {(r["step"], r["layer"], r["operand"], r["gemm"]): r for r in records}


def test_counts_match_constructed_tensors():
    layer = Float8Linear(DIM, DIM, bias=False, config=_static_config())
    with torch.no_grad():
        layer.weight.copy_(_known("weight", (DIM, DIM), 0.5))
    model = nn.Sequential(OrderedDict(proj=layer))
    x = _known("input", (8, DIM), 1.0).requires_grad_()
    grad = _known("grad_output", (8, DIM), 1.0)
    with Float8Telemetry(model, every=1, saturation_warn=None, underflow_warn=None) as tel:
        model(x).backward(grad)
        records = tel.flush()
    assert [tuple(r) for r in records] == [RECORD_FIELDS] * 3
    hps = {"input": x, "weight": layer.weight, "grad_output": grad}
    for r in records:
        hp = hps[r["operand"]].detach()
        n_sat, n_under, *_ = COUNTS[r["operand"]]
        assert r["saturation"] == n_sat / hp.numel(), r
        assert r["underflow"] == n_under / hp.numel(), r
        assert r["amax"] == abs(HUGE[r["operand"]]) and r["scale"] == r["scale_max"] == 1.0
        # the shared helpers agree (and so does a cast by hand)
        one = torch.tensor(1.0)
        dtype = layer.plan.dtypes[(Operand(r["operand"]), Gemm(r["gemm"]))]
        assert r["saturation"] == out_of_range_fraction(hp, one, dtype).item()
        assert r["underflow"] == underflow_fraction(hp, one, dtype).item()
        fp8 = hp.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype).float()
        assert ((fp8 == 0) & (hp != 0)).sum().item() == n_under
    assert tel.flush() == []


def test_rounding_max_is_where_rounding_stops_reaching_the_max():
    assert float8_rounding_max(E4M3) == 464.0
    assert float8_rounding_max(torch.float8_e5m2) == 61440.0
    # e5m2 overflows to inf without the clamp: just below the bound still rounds to the max
    near = torch.tensor([61439.0, 61441.0]).to(torch.float8_e5m2).float()
    assert near.tolist() == [57344.0, float("inf")]


def test_samples_every_n_and_launches_nothing_between(monkeypatch):
    model = _model(Float8LinearConfig.tensorwise())
    calls = []
    original = telemetry_mod.cast_stats
    monkeypatch.setattr(telemetry_mod, "cast_stats", lambda *a: calls.append(1) or original(*a))
    tel = Float8Telemetry(model, every=3)
    for step in range(7):
        before = len(calls)
        assert bool(model.up._forward_pre_hooks) == (step % 3 == 0)  # hooks: sampled steps only
        _train_step(model, step)
        assert (len(calls) > before) == (step % 3 == 0), step
        tel.step()
    records = tel.flush()
    assert sorted({r["step"] for r in records}) == [0, 3, 6]
    assert len(records) == 3 * 2 * 3  # steps x layers x operands

    # A non-sampled step runs exactly the ops it runs without telemetry.
    def ops_of_step() -> list:
        with OpLog() as log:
            _train_step(model, 99)
        return log.ops

    assert not tel.sampling
    with_telemetry = ops_of_step()
    tel.remove()
    assert with_telemetry == ops_of_step()


def test_checkpoint_recompute_is_not_recorded_twice():
    model = _model(Float8LinearConfig.tensorwise())
    tel = Float8Telemetry(model, every=1)
    x = torch.randn(8, 32)
    checkpoint(model, x, use_reentrant=False).sum().backward()
    assert tel.records() == tel.records()  # records() reads without clearing
    keys = [(r["layer"], r["operand"]) for r in tel.flush()]
    assert sorted(keys) == sorted({(f, op.value) for f in ("up", "down") for op in Operand})


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="every=0"):
        Float8Telemetry(_model(Float8LinearConfig.tensorwise()), every=0)
    with pytest.raises(ValueError, match="convert_to_float8_training"):
        Float8Telemetry(nn.Sequential(nn.Linear(16, 16)))


def test_warning_names_layer_operand_and_value():
    model = _model(_static_config(scale=448.0 / 0.5))  # inputs of randn saturate
    tel = Float8Telemetry(model, every=1, saturation_warn=1e-3, underflow_warn=0.5)
    _train_step(model, 0)
    with pytest.warns(Float8NumericsWarning) as caught:
        records = tel.flush()
    messages = [str(w.message) for w in caught]
    saturating = [r for r in records if r["saturation"] > 1e-3]
    assert saturating and len(messages) >= len(saturating)
    for r in saturating:
        assert any(
            f"saturation in {r['layer']} ({r['operand']}" in m and f"{r['saturation']:.3g}" in m
            for m in messages
        ), (r, messages)
    assert any("saturation in up (input" in m for m in messages)

    healthy = _model(Float8LinearConfig.tensorwise())
    quiet = Float8Telemetry(healthy, every=1, saturation_warn=1e-3, underflow_warn=0.1)
    _train_step(healthy, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Float8NumericsWarning)
        assert len(quiet.flush()) == 2 * 3  # dynamic scales: below both thresholds


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_dynamic_recipes_report_the_layers_scale(recipe):
    model = _model(Float8LinearConfig.from_recipe_name(recipe))
    seen = {}
    for fqn, m in model.named_modules():
        if isinstance(m, Float8Linear):
            m.register_forward_pre_hook(lambda mod, args, fqn=fqn: seen.__setitem__(fqn, args[0]))
    tel = Float8Telemetry(model, every=1, all_casts=True)
    _train_step(model, 0)
    records = _by_key(tel.flush())
    gemms = {(r[1], r[2]): set() for r in records}
    for _, layer, op, gemm in records:
        gemms[(layer, op)].add(gemm)
    n_gemms = 1 if recipe == "tensorwise" else 2  # tensorwise reuses one cast per operand
    assert len(gemms) == 2 * 3 and all(len(g) == n_gemms for g in gemms.values())
    for layer, m in (("up", model.up), ("down", model.down)):
        x = seen[layer].reshape(-1, 32)
        for gemm in (Gemm.OUTPUT, Gemm.GRAD_WEIGHT)[:n_gemms]:
            r = records[(0, layer, "input", gemm.value)]
            strategy = m.plan.strategies[(Operand.INPUT, gemm)]
            scale = strategy.scale(x, CONTRACTION_DIM[(gemm, Operand.INPUT)], E4M3)
            assert (r["scale"], r["scale_max"]) == (scale.min().item(), scale.max().item())
            assert r["amax"] == x.abs().max().item() and r["saturation"] == 0.0
        if recipe == "tensorwise":
            w = records[(0, layer, "weight", "output")]
            assert w["scale"] == amax_to_scale(m.weight.detach().abs().max(), E4M3).item()
    if recipe == "rowwise":
        r = records[(0, "up", "input", "output")]
        assert r["scale"] < r["scale_max"]  # per-row scales differ (power-of-2)


def test_delayed_uses_module_scale_and_leaves_state_untouched():
    delayed = CastConfig(scaling_type="delayed")
    config = Float8LinearConfig(
        cast_config_input=delayed, cast_config_weight=delayed, cast_config_grad_output=delayed
    )
    observed, plain = _model(config), _model(config)
    tel = Float8Telemetry(observed, every=1, saturation_warn=None)
    scales = []
    for step in range(3):
        scales.append({k: v.clone() for k, v in observed.state_dict().items() if "fp8_scale" in k})
        for model in (observed, plain):
            _train_step(model, step, sync=True)
        tel.step()
    for (name, a), b in zip(observed.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name  # telemetry recorded no amax into the buffers
    for (step, layer, op, _), r in _by_key(tel.flush()).items():
        if step == 0:  # before the first sync: the operand's own amax, as the layer does
            dtype = E4M3 if op != "grad_output" else torch.float8_e5m2
            assert r["scale"] == amax_to_scale(torch.tensor(r["amax"]), dtype).item()
        else:
            assert r["scale"] == scales[step][f"{layer}.delayed_scaling.fp8_scale_{op}"].item()


def _fsdp2_float8_all_gather_run(rank: int, world_size: int) -> dict:
    """On one fresh gloo rank (`run_distributed`): two steps of a static-scaled layer whose
    weight FSDP2 gathers in float8, telemetry attached before fully_shard."""
    from torch.distributed.fsdp import fully_shard

    config = Float8LinearConfig(
        cast_config_weight=CastConfig(scaling_type="static", static_scale=1.0),
        enable_fsdp_float8_all_gather=True,
    )
    model = nn.Sequential(OrderedDict(proj=nn.Linear(DIM, DIM, bias=False)))
    with torch.no_grad():
        model.proj.weight.copy_(_known("weight", (DIM, DIM), 0.5))
    convert_to_float8_training(model, config=config)
    tel = Float8Telemetry(model, every=1, saturation_warn=None, underflow_warn=None)
    fully_shard(model, mesh=cpu_mesh(1))
    gathered = []
    model.proj.register_forward_pre_hook(
        lambda m, a: gathered.append(isinstance(m.weight, Float8Tensor))
    )
    warned = []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(torch.randn(8, DIM)).sum().backward()
        warned.append(any("after fully_shard" in str(w.message) for w in caught))
        tel.step()
    weights = {r["step"]: r for r in tel.flush() if r["operand"] == "weight"}
    return {"gathered": gathered, "warned": warned, "weights": weights}


def test_fsdp2_float8_all_gather_weight_uses_sharded_hp(tmp_path):
    """Attached before fully_shard: step 0 has no sharded weight yet (saturation and
    underflow None, a warning); from step 1 the sharded hp weight gives exact counts. In a
    process of its own, so a process group left by another test cannot interfere."""
    (out,) = run_distributed(_fsdp2_float8_all_gather_run, 1, tmp_path)
    assert out["gathered"] == [True, True] and out["warned"] == [True, False]
    first, second = out["weights"][0], out["weights"][1]
    assert (first["saturation"], first["underflow"], first["scale"]) == (None, None, 1.0)
    assert first["amax"] == 448.0  # dequantized: the saturated elements read as the max
    n_sat, n_under, *_ = COUNTS["weight"]
    assert (second["saturation"], second["underflow"]) == (n_sat / DIM**2, n_under / DIM**2)
    assert second["amax"] == 600.0 and second["scale"] == 1.0
