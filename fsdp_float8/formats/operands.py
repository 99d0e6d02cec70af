"""A gathered weight's GEMM operands, built once per unshard: `GatheredOperands`.

Mental model. FSDP2 all-gathers a weight's float8 shards into one unsharded `Float8Tensor`
whose data is already the output GEMM's operand (a row-major (N, K) weight is the
column-major (K, N) operand that GEMM takes). The grad_input GEMM contracts over the other
dim and wants the weight the other way round: column-major (N, K), and for per-row scales a
re-cast along the columns. Each format module says how its weight becomes each GEMM's
operand (`operand_kind`, `build_operand`; `weight_operands.weight_for` asks). That operand is
built at its first use after an all-gather and reused until the next one: by every backward
that runs while the weight stays unsharded (`reshard_after_forward=False`, micro-batches
with the reshard after backward held back). Activation-checkpoint recompute re-runs only the
output GEMM, which takes the gathered data as it is.

Memory follows FSDP2's own buffers: the operand's buffers join the post-all-gather hook's
inner tensors, which FSDP2 frees at reshard and re-allocates at the next unshard, so the
operand lives exactly as long as the gathered weight (one extra byte per element: float8
rows plus float8 columns, the two bytes per element of a bf16-gathered weight).

Under torch.compile the record is not part of the traced tensor (`Float8Tensor`'s
flattening carries data, scale and a tensorwise weight's `1 / scale` only): the graph builds
the operand itself, with the same values (`formats.weight_operands.weight_for`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fsdp_float8.core.cast_plan import CastPlan
from fsdp_float8.core.float8_tensor import Float8Tensor
from fsdp_float8.core.gemms import Gemm, Operand
from fsdp_float8.core.scaling import DynamicScaling

Pair = tuple[torch.Tensor, torch.Tensor | None]

# how a gathered weight becomes a GEMM's operand (a format's `operand_kind`): its data and
# scale as they are; an operand built once per unshard (`build_operand`, kept in
# `GatheredOperands`); or a cast built at each use (`build_operand`, kept nowhere)
AS_IS, CACHED, CAST = "as_is", "cached", "cast"
# build(previous operand or None) -> (operand, buffers it newly allocated): the previous
# operand's tensors are the buffers to write into (FSDP2 re-allocated them)
Build = Callable[[Pair | None], tuple[Pair, tuple[torch.Tensor, ...]]]


@dataclass(eq=False)
class GatheredOperands:
    """The unsharded weight's GEMM operands that are not the gathered data as it is,
    each built once per unshard (module docstring). Keyed by the GEMM."""

    # the post-all-gather hook's inner tensors, the very list FSDP2 keeps: it frees each
    # at reshard and re-allocates each before the next post-all-gather call
    inner: list[torch.Tensor]
    # a one-scale weight's (scale, 1 / scale), refilled with the data: its [0] is the
    # weight's `_scale`, its [1] the weight's `_inverse` (what the GEMMs multiply by)
    scales: torch.Tensor | None = None
    builds: int = 0  # how many times an operand was built (tests count it)
    _operands: dict[object, Pair] = field(default_factory=dict, repr=False)
    _fresh: set[object] = field(default_factory=set, repr=False)

    def refilled(self) -> None:
        """FSDP2 gathered new values into the weight: every operand must be rebuilt."""
        self._fresh.clear()

    def operand(self, gemm: object, build: Build) -> Pair:
        if gemm in self._fresh:
            return self._operands[gemm]
        operand, new_buffers = build(self._operands.get(gemm))
        for buffer in new_buffers:  # FSDP2 frees and re-allocates them with the weight's
            whole = buffer.storage_offset() == 0 and buffer.numel() * buffer.itemsize == (
                buffer.untyped_storage().nbytes()
            )
            assert whole, "an operand buffer must span its whole storage"
            self.inner.append(buffer)
        self._operands[gemm] = operand
        self._fresh.add(gemm)
        self.builds += 1
        return operand


def column_major(data: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, tuple]:
    """An (N, K) weight's data copied column-major (the right operand of grad_input), into
    `out` (the previous unshard's copy) when given: (copy, buffers newly allocated)."""
    if out is None:  # a row-major (K, N) buffer
        columns = torch.empty((data.shape[1], data.shape[0]), dtype=data.dtype, device=data.device)
    else:
        columns = out.t()
    columns.copy_(data.t())
    return columns.t(), (() if out is not None else (columns,))


def read_here(scale: torch.Tensor) -> None:
    """A scale made on FSDP2's all-gather copy-in stream, read on the current stream:
    without this the caching allocator may hand its memory to the next block's prefetch
    (on the copy-in stream) before the read has run."""
    if scale.is_cuda:
        scale.record_stream(torch.cuda.current_stream(scale.device))


def unsharded(out, gathered: torch.Tensor) -> Float8Tensor:
    """`out` checked as the weight a refill updates: a Float8Tensor whose data views the
    all-gather output FSDP2 just refilled (its storage, kept across reshard and unshard)."""
    if not isinstance(out, Float8Tensor):
        raise TypeError(f"expected the unsharded Float8Tensor as out, got {type(out)}")
    if out._data.untyped_storage()._cdata != gathered.untyped_storage()._cdata:
        raise RuntimeError(
            f"refill of an unsharded float8 weight {tuple(out.shape)} whose data does not "
            f"view the gathered buffer {tuple(gathered.shape)} FSDP2 refilled: the weight "
            "would keep stale values. Its data was replaced after the first all-gather; "
            "leave FSDP2's unsharded parameters as FSDP2 built them"
        )
    return out


def attach_operands(
    weight: Float8Tensor, inner: list[torch.Tensor], scales: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Give a freshly built unsharded weight its once-per-unshard operands record; `inner`
    (the tensors FSDP2 frees and refills) is the list the record extends; `scales`:
    (scale, 1 / scale) of a one-scale weight, whose [0] is `weight._scale`."""
    weight._operands = GatheredOperands(inner, scales=scales)
    return inner


def refilled(out: Float8Tensor) -> None:
    if out._operands is not None:
        out._operands.refilled()


def plain_grad_input_cast(weight: torch.Tensor, plan: CastPlan, devices) -> DynamicScaling | None:
    """grad_input's weight cast where a format may build a plain weight's grad_input operand
    itself in a compiled graph (its `plain_operand`, or the layer's row-scale path): compiled
    for one of `devices` (GPU Inductor's reductions), a 2-D high-precision weight not re-cast
    from its rows (`CastPlan.weight_from_rows`), the cast dynamic from the weight's own amax
    (no reduction over a group, as a tensor-parallel shard's). None otherwise."""
    strategy = plan.strategies[(Operand.WEIGHT, Gemm.GRAD_INPUT)]
    if (
        torch.compiler.is_compiling()
        and weight.device.type in devices
        and weight.dim() == 2
        and not plan.weight_from_rows
        and isinstance(strategy, DynamicScaling)
        and strategy.group is None
    ):
        return strategy
    return None
