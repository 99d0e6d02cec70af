"""Per-layer numerics telemetry: what each cast of each quantized linear does to its operand.

    tel = Float8Telemetry(model, every=100, saturation_warn=1e-3, underflow_warn=0.1)
    for batch in data:
        loss = model(batch).sum(); loss.backward(); opt.step()
        tel.step()                    # end of each training step
        if log_now: metrics.extend(tel.flush())  # the one host read; warnings fire here

Mental model: hooks attached from outside (nothing in `Float8Linear` changes), and only for
the sampled steps (`current_step % every == 0`): `step()` attaches them before a sampled
step and removes them after it, so other steps run the model untouched. On a sampled step
the hooks compute, for each cast, a few statistics as one small float32 tensor that stays
on the device. `records()` / `flush()` stack every pending tensor and read them to the host
in one transfer; threshold warnings fire then, since checking a value sooner would be a
host sync.

One record per (sampled step, layer, operand, GEMM cast):
- `amax`: max |hp| of the operand as the layer sees it.
- `scale`, `scale_max`: the scale the layer's strategy uses for that cast (min and max over
  its entries: equal for tensorwise; the per-row extremes for axiswise). Computed with
  `plan.strategies[(operand, gemm)]`, so dynamic, delayed and static agree with the layer by
  construction; delayed scaling gets a scratch copy of the layer's state, so the module's
  recorded amax is never touched.
- `saturation`: fraction of elements that saturate beyond rounding: |hp * scale| above the
  largest value that rounds to the float8 max (e4m3fn 464, e5m2 61440;
  `numerics.out_of_range_fraction`). Elements between the max and that bound are clamped
  by no more than rounding would move them; counting them (`saturation_fraction`, > max)
  would report the amax element of a dynamically scaled tensor whenever its float32 scale
  rounded up, i.e. warn about layers that are fine.
- `underflow`: fraction of elements non-zero in hp and zero in float8
  (`numerics.underflow_fraction`).
- `sqnr`: None for a float8 cast (see below for the 4-bit layer's).
Both fractions are over all elements of the operand. `None` marks a value that cannot be
known (see weights).

A quantized linear of a format with a layer of its own (the 4-bit linear) computes
its records itself (its `telemetry_stats` / `telemetry_weight_stats`, the cast it observes
per operand in `TELEMETRY_CASTS`): input, weight and grad_output, each cast for its first
GEMM as the layer casts it (grad_output with the layer's stochastic rounding draws).
`float8_dtype` is then the format's word (`TELEMETRY_FORMAT`); `amax` as above; `scale`,
`scale_max`: the extremes over the blocks of 1 / (block factor * tensor factor);
`saturation`: scaled magnitudes above the largest value that rounds to the format's max;
`underflow` as above; `sqnr`: 20 log10(|hp| / |hp - dequantized|) in dB. Its weight,
gathered by FSDP2, is compared row for row with this rank's shard; `all_casts` adds
nothing for it.

Where each operand is observed:
- input: a forward pre-hook, after autocast's cast as the layer does it.
- grad_output: a tensor hook on the layer's output, registered only on sampled forwards.
- weight: a forward pre-hook (FSDP2 prepends its unshard hook, so the weight is unsharded).
  A high-precision weight is observed as cast. A weight that arrives as a `Float8Tensor`
  (FSDP2 float8 all-gather) has lost its high-precision values: clamped and flushed elements
  look like legitimate ones, so saturation and underflow cannot be read from it. Telemetry
  then uses this rank's sharded high-precision weight (the FSDP2 sharded parameter, looked
  up between steps) with the gathered tensor's scale, which is exactly the (shard, scale)
  pair the all-gather cast; `amax` is then this rank's shard amax. Without a sharded
  parameter (telemetry attached before `fully_shard`, first step) the record carries the
  gathered scale and dequantized amax, with saturation and underflow `None`.

By default each operand is observed for its first enabled cast (input and weight for the
output GEMM, grad_output for grad_input); `all_casts=True` adds the second GEMM's cast when
it differs (e.g. rowwise along the other dim). Only training-mode forwards are sampled,
and not the recompute of activation checkpointing; every forward of a sampled step adds
records (gradient accumulation: one set per microbatch). Records are this rank's: log them
from rank 0. Under torch.compile the hooks run eagerly (`torch.compiler.disable`): sampled
steps take graph breaks (so not with `fullgraph=True`), other steps run the usual graph.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_float8.core.blocks import expand_block_scale
from fsdp_float8.core.cast_plan import CastPlan
from fsdp_float8.core.float8_tensor import Float8Tensor
from fsdp_float8.core.gemms import CONTRACTION_DIM, OPERAND_GEMMS, Gemm, Operand
from fsdp_float8.core.numerics import out_of_range_fraction, underflow_fraction
from fsdp_float8.core.scaling import tensor_amax
from fsdp_float8.nn.linear import Float8Linear
from fsdp_float8.tools.telemetry_records import (  # noqa: F401  (part of this API)
    RECORD_FIELDS,
    Float8NumericsWarning,
    PendingRecord,
    append_jsonl,
    host_records,
    warn_past_thresholds,
)
from fsdp_float8.weight_wrappers.base import plain_weight


def cast_stats(hp: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """(amax, min scale, max scale, saturation, underflow) as one float32 device tensor."""
    hp = hp.detach()
    scale = scale.detach().to(torch.float32)
    if hp.numel() == 0:  # an empty FSDP shard: nothing saturates or underflows
        zero = torch.zeros((), dtype=torch.float32, device=hp.device)
        return torch.stack([zero, scale.min(), scale.max(), zero, zero])
    return torch.stack(
        [
            tensor_amax(hp),
            scale.min(),
            scale.max(),
            out_of_range_fraction(hp, scale, float8_dtype).to(torch.float32),
            underflow_fraction(hp, scale, float8_dtype).to(torch.float32),
        ]
    )


class ObservedLayer(Protocol):
    """A quantized linear that computes its own records (a format with a layer of its own,
    the 4-bit one): `Float8Telemetry` observes it through these, without its class."""

    TELEMETRY_FORMAT: str
    TELEMETRY_CASTS: dict[Operand, Gemm]
    training: bool

    def telemetry_stats(self, operand: Operand, hp: torch.Tensor) -> torch.Tensor: ...

    def telemetry_weight_stats(self, sharded: DTensor | None) -> tuple[torch.Tensor, bool]: ...


def _observes_itself(m: nn.Module) -> bool:
    return callable(getattr(m, "telemetry_stats", None))


class Float8Telemetry:
    """Samples every `every` steps the casts of every Float8Linear (and 4-bit linear) in
    `model`.

    Call `step()` once per training step (after the optimizer step); the step numbered
    `current_step` is sampled when `current_step % every == 0` (step 0 is). Thresholds of
    `None` disable that warning. Use as a context manager, or call `remove()`, to detach.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        every: int = 100,
        saturation_warn: float | None = 1e-3,
        underflow_warn: float | None = 0.1,
        all_casts: bool = False,
        start_step: int = 0,
    ) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every={every!r}; expected an int >= 1 (sample every N steps)")
        for name, value in (
            ("saturation_warn", saturation_warn),
            ("underflow_warn", underflow_warn),
        ):
            if value is not None and not 0 <= value <= 1:
                raise ValueError(f"{name}={value!r} is a fraction of elements; use [0, 1] or None")
        self.layers: dict[str, Any] = {
            fqn: m
            for fqn, m in model.named_modules()
            if isinstance(m, Float8Linear) or (isinstance(m, nn.Linear) and _observes_itself(m))
        }
        if not self.layers:
            raise ValueError(
                f"{type(model).__name__} has no Float8Linear (or 4-bit linear) to observe; call "
                "convert_to_float8_training(model, ...) before attaching Float8Telemetry"
            )
        self.every = every
        self.saturation_warn = saturation_warn
        self.underflow_warn = underflow_warn
        self.current_step = start_step
        self._casts = {
            fqn: _observed_casts(m.plan, all_casts)
            if isinstance(m, Float8Linear)
            else {op: [gemm] for op, gemm in m.TELEMETRY_CASTS.items()}
            for fqn, m in self.layers.items()
        }
        self._pending: list[PendingRecord] = []
        self._host: list[dict[str, Any]] = []
        self._sharded_weights: dict[str, DTensor] = {}
        self._warned_no_shard: set[str] = set()
        self._handles: list = []
        self._closed = False
        self._find_sharded_weights()
        self._sync_hooks()

    # -- the user's side -------------------------------------------------------------------
    @property
    def sampling(self) -> bool:
        """Whether the current step is sampled (a host-side int test, no device work)."""
        return self.current_step % self.every == 0

    def step(self) -> None:
        """End of a training step: advance the counter, look up FSDP2 sharded weights, and
        attach the hooks for a sampled step (detach them after it)."""
        self.current_step += 1
        self._find_sharded_weights()
        self._sync_hooks()

    def records(self) -> list[dict[str, Any]]:
        """Every record since the last `flush()`, read to the host (one transfer)."""
        self._drain()
        return [dict(r) for r in self._host]

    def flush(self) -> list[dict[str, Any]]:
        """Return and clear the records: plain JSON-ready dicts (see `RECORD_FIELDS`)."""
        self._drain()
        out, self._host = self._host, []
        return out

    def remove(self) -> None:
        """Detach for good (records already taken stay readable)."""
        self._closed = True
        self._sync_hooks()

    def __enter__(self) -> Float8Telemetry:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # -- hooks -------------------------------------------------------------------------
    def _sync_hooks(self) -> None:
        # Hooks exist only during sampled steps: other steps run the model untouched (no
        # hook call at all; a compiled block keeps its hook-free graph).
        want = self.sampling and not self._closed
        if want and not self._handles:
            for fqn, m in self.layers.items():
                pre = self._hook(self._pre_forward, fqn)
                self._handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
                self._handles.append(m.register_forward_hook(self._hook(self._post_forward, fqn)))
        elif not want:
            for h in self._handles:
                h.remove()
            self._handles.clear()

    def _hook(self, fn, fqn: str):
        # run eagerly under torch.compile: a graph break on sampled steps only
        return torch.compiler.disable(lambda module, *args: fn(fqn, module, *args))

    @staticmethod
    def _observing(module: Float8Linear) -> bool:
        # training forwards only; not the recompute of activation checkpointing (in backward)
        return module.training and torch._C._current_graph_task_id() == -1

    def _pre_forward(self, fqn: str, module: Float8Linear, args, kwargs) -> None:
        if not self._observing(module):
            return
        x = args[0] if args else kwargs["input"]
        with torch.no_grad():
            if torch.is_autocast_enabled(x.device.type):  # as Float8Linear.forward does
                x = x.to(torch.get_autocast_dtype(x.device.type))
            self._observe(fqn, module, Operand.INPUT, x.reshape(-1, x.shape[-1]))
            self._observe_weight(fqn, module)

    def _post_forward(self, fqn: str, module: Float8Linear, args, output) -> None:
        if not (self._observing(module) and Operand.GRAD_OUTPUT in self._casts[fqn]):
            return
        if not (torch.is_grad_enabled() and output.requires_grad):
            return
        step = self.current_step  # backward may run after step(): keep the forward's number

        def on_grad(grad: torch.Tensor) -> None:
            with torch.no_grad():
                hp = grad.reshape(-1, grad.shape[-1])
                self._observe(fqn, module, Operand.GRAD_OUTPUT, hp, step=step)

        output.register_hook(on_grad)

    # -- statistics ------------------------------------------------------------------------
    def _observe(self, fqn, module, operand, hp, *, step: int | None = None) -> None:
        step = self.current_step if step is None else step
        if not isinstance(module, Float8Linear):  # a layer that observes itself
            for gemm in self._casts[fqn].get(operand, ()):
                stats = module.telemetry_stats(operand, hp)
                self._add(step, fqn, operand, gemm, module.TELEMETRY_FORMAT, stats)
            return
        for gemm in self._casts[fqn].get(operand, ()):
            strategy = module.plan.strategies[(operand, gemm)]
            assert strategy is not None  # `_observed_casts` keeps the enabled casts only
            dtype = module.plan.dtypes[(operand, gemm)]
            dim = CONTRACTION_DIM[(gemm, operand)]
            scale = strategy.scale(hp, dim, dtype, _scratch_state(module, operand))
            scale = strategy.granularity.broadcastable(scale, hp, dim)  # block scales expand
            self._add(step, fqn, operand, gemm, dtype, cast_stats(hp, scale, dtype))

    def _observe_weight(self, fqn: str, module) -> None:
        if not isinstance(module, Float8Linear):
            self._observe_own_weight(fqn, module)
            return
        weight = module.weight
        if not isinstance(weight, Float8Tensor):
            self._observe(fqn, module, Operand.WEIGHT, plain_weight(weight))
            return
        gemms = self._casts[fqn].get(Operand.WEIGHT, ())
        if not gemms:
            return
        # one gathered Float8Tensor serves both weight GEMMs: one record
        shard = self._sharded_weights.get(fqn)
        if shard is not None and weight._block is not None:
            # block scales are local to the shard: recomputed from it, they are exactly the
            # ones its all-gather cast used
            self._observe(fqn, module, Operand.WEIGHT, plain_weight(shard.to_local()))
            return
        if shard is not None:
            hp = plain_weight(shard.to_local())
            stats = cast_stats(hp, weight._scale, weight.float8_dtype)
        else:
            self._warn_no_shard(fqn)
            deq = weight.dequantize()
            scale = weight._scale
            if weight._block is not None:
                scale = expand_block_scale(scale, weight._block, deq.shape)
            stats = cast_stats(deq, scale, weight.float8_dtype)
            stats[3:] = float("nan")
        self._add(self.current_step, fqn, Operand.WEIGHT, gemms[0], weight.float8_dtype, stats)

    def _observe_own_weight(self, fqn: str, module: ObservedLayer) -> None:
        gemms = self._casts[fqn].get(Operand.WEIGHT, ())
        if not gemms:
            return
        stats, known = module.telemetry_weight_stats(self._sharded_weights.get(fqn))
        if not known:
            self._warn_no_shard(fqn)
        fmt = module.TELEMETRY_FORMAT
        self._add(self.current_step, fqn, Operand.WEIGHT, gemms[0], fmt, stats)

    def _add(self, step, fqn, operand, gemm, dtype, stats) -> None:
        self._pending.append(PendingRecord.of(step, fqn, operand, gemm, dtype, stats))

    def _find_sharded_weights(self) -> None:
        # Between steps FSDP2 has resharded, so the module's weight is the sharded parameter
        # (the object the optimizer updates); re-read each step in case it was replaced.
        for fqn, m in self.layers.items():
            if isinstance(m.weight, DTensor):
                self._sharded_weights[fqn] = m.weight

    def _warn_no_shard(self, fqn: str) -> None:
        if fqn in self._warned_no_shard:
            return
        self._warned_no_shard.add(fqn)
        warnings.warn(
            f"Float8Telemetry: {fqn}.weight arrived all-gathered (quantized) and "
            "no FSDP2 sharded weight is known yet, so its saturation and underflow are "
            "recorded as None this step; attach Float8Telemetry after fully_shard",
            Float8NumericsWarning,
            stacklevel=2,
        )

    # -- host side -------------------------------------------------------------------------
    def _drain(self) -> None:
        pending, self._pending = self._pending, []
        for record in host_records(pending):  # one host read for them all
            warn_past_thresholds(record, self.saturation_warn, self.underflow_warn)
            self._host.append(record)


def _observed_casts(plan: CastPlan, all_casts: bool) -> dict[Operand, list[Gemm]]:
    """Per operand, the GEMMs whose cast is observed: the first enabled one, plus (with
    all_casts) the second unless the layer reuses the first cast for it."""
    out: dict[Operand, list[Gemm]] = {}
    for op, (first, second) in OPERAND_GEMMS.items():  # primary, then second use
        gemms = [g for g in (first, second) if plan.strategies[(op, g)] is not None]
        if len(gemms) == 2 and (not all_casts or plan.shares_cast(op, first, second)):
            gemms = gemms[:1]
        if gemms:
            out[op] = gemms
    return out


def _scratch_state(module: Float8Linear, operand: Operand):
    """A copy of the layer's delayed state (None when the operand is not delayed): the
    strategy computes exactly the layer's scale, and records its amax into the copy."""
    delayed = module.delayed_scaling
    return delayed.scratch(operand) if delayed is not None else None
