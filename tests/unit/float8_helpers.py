"""Shared by the float8 unit tests: configs for the recipe x scaling grid and the SQNRs of a
Float8Linear against a float32 reference. Thresholds live in `fsdp_float8.core.numerics.SQNR_DB`.

Grid: every recipe ('tensorwise', 'rowwise', 'rowwise_with_gw_hp') with
- dynamic: the recipe as named;
- delayed / static: the tensorwise casts become delayed / static. For 'tensorwise' that is
  every operand (input, weight, grad_output); for the rowwise recipes it is the weight (for
  both of its GEMMs), since delayed and static scaling are tensorwise only and the
  activations stay dynamic axiswise.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_float8 import (
    CastConfig,
    Float8Linear,
    Float8LinearConfig,
    sqnr_db,
    sync_float8_amax_and_scale_history,
)
from fsdp_float8.core.config import E4M3, E5M2
from fsdp_float8.core.scaling import float8_max

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
SCALINGS = ("dynamic", "delayed", "static")
IN_FEATURES, OUT_FEATURES = 64, 48
BATCH, SEQ = 2, 8
DELAYED_WARMUP_STEPS = 3

# Expected amaxes of the test data: randn activations (|x| < ~4.5 for 1k samples) and
# nn.Linear's uniform(+-1/sqrt(in_features)) weight. Static scales leave 2x headroom or
# more: rounded down to a power of two, which the rowwise recipes' power-of-two rule asks
_STATIC_AMAX = {"input": 8.0, "weight": 2.0 / IN_FEATURES**0.5, "grad_output": 8.0}


def _static(operand: str, dtype: torch.dtype) -> CastConfig:
    scale = 2.0 ** math.floor(math.log2(float8_max(dtype) / _STATIC_AMAX[operand]))
    return CastConfig(scaling_type="static", static_scale=scale, target_dtype=dtype)


def make_config(recipe: str, scaling: str, **overrides) -> Float8LinearConfig:
    base = Float8LinearConfig.from_recipe_name(recipe, **overrides)
    if scaling == "dynamic":
        return base
    if scaling == "delayed":
        cast = {op: CastConfig(scaling_type="delayed", target_dtype=dt) for op, dt in _DTYPES}
    elif scaling == "static":
        cast = {op: _static(op, dt) for op, dt in _DTYPES}
    else:
        raise ValueError(f"unknown scaling {scaling!r}; expected one of {SCALINGS}")
    if recipe == "tensorwise":
        fields = {f"cast_config_{op}": cast[op] for op in cast}
    else:
        fields = {"cast_config_weight": cast["weight"], "cast_config_weight_for_grad_input": None}
    return Float8LinearConfig.from_recipe_name(recipe, **fields, **overrides)


_DTYPES = (("input", E4M3), ("weight", E4M3), ("grad_output", E5M2))


def make_linear(
    config: Float8LinearConfig,
    dtype: torch.dtype = torch.float32,
    *,
    bias: bool = True,
    seed: int = 0,
    in_features: int = IN_FEATURES,
    out_features: int = OUT_FEATURES,
) -> Float8Linear:
    torch.manual_seed(seed)
    hp = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    return Float8Linear.from_float(hp, config)


def make_batch(dtype: torch.dtype, seed: int, in_features: int = IN_FEATURES, out=OUT_FEATURES):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, SEQ, in_features, generator=g).to(dtype)
    grad_output = torch.randn(BATCH, SEQ, out, generator=g).to(dtype)
    return x, grad_output


def warm_up(mod: Float8Linear, steps: int = DELAYED_WARMUP_STEPS) -> None:
    """A few training steps with a sync between them, as a training loop would do."""
    for step in range(steps):
        x, grad_output = make_batch(
            mod.weight.dtype, 100 + step, mod.in_features, out=mod.out_features
        )
        mod(x.requires_grad_()).backward(grad_output)
        sync_float8_amax_and_scale_history(mod)
    mod.zero_grad(set_to_none=True)


def run_linear(mod: nn.Module, x: torch.Tensor, grad_output: torch.Tensor):
    """(output, grad_input, grad_weight) of one forward + backward."""
    mod.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = mod(x)
    out.backward(grad_output)
    return out.detach(), x.grad, mod.weight.grad.clone()


def reference(mod: nn.Linear, x: torch.Tensor, grad_output: torch.Tensor):
    """The same linear in float32 on the same (possibly bf16) values."""
    ref = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
    with torch.no_grad():
        ref.weight.copy_(mod.weight.float())
        if mod.bias is not None:
            ref.bias.copy_(mod.bias.float())
    return run_linear(ref, x.float(), grad_output.float())


def linear_sqnrs(mod: Float8Linear, x: torch.Tensor, grad_output: torch.Tensor):
    """SQNR (dB) of output, grad_input, grad_weight against the float32 reference, and the
    float8 results themselves."""
    got = run_linear(mod, x, grad_output)
    want = reference(mod, x, grad_output)
    names = ("output", "grad_input", "grad_weight")
    return {n: sqnr_db(w, g) for n, w, g in zip(names, want, got)}, got


class OpLog(TorchDispatchMode):
    """Records every aten op that runs under it, in order (`.ops`)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def gpu_path_runs(config, w: torch.Tensor, x: torch.Tensor, place, devices: str, count) -> dict:
    """A plain float8 linear (weight `w`) run three ways on `x`: "eager"; "compiled"; and
    "compiled here", with the CPU counted as a device of a compiled GPU-only path (`place`'s
    `devices` tuple patched to ("cpu",)). Each run: (input grad, weight grad, `count` of the
    forward and backward graphs AOTAutograd made, a list of GraphModules)."""
    from unittest import mock

    from torch._dynamo.backends.common import aot_autograd

    from fsdp_float8 import Float8Linear

    results = {}
    for run in ("eager", "compiled", "compiled here"):
        layer = Float8Linear.from_float(nn.Linear(w.shape[1], w.shape[0], bias=False), config)
        layer.weight.data.copy_(w)
        xi = x.clone().requires_grad_()
        graphs: list = []

        def keep(gm, _inputs, graphs=graphs):
            graphs.append(gm)
            return gm

        patched = ("cpu",) if run == "compiled here" else getattr(place, devices)
        with mock.patch.object(place, devices, patched):
            backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)
            fn = layer if run == "eager" else torch.compile(layer, backend=backend, fullgraph=True)
            fn(xi).square().sum().backward()
        torch._dynamo.reset()
        results[run] = (xi.grad, layer.weight.grad, count(graphs))
    return results
