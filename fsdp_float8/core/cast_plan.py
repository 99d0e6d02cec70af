"""The cast plan: a layer's casts resolved once from its config, for every float8 GEMM family.

Mental model. A `Float8LinearConfig` says, in user words, how each operand is cast for each
of the three GEMMs; a `CastPlan` is that resolved into behaviour (a scaling strategy and a
float8 dtype per (operand, GEMM), fast accumulation per GEMM, the block shapes the GEMM
sees), computed once when a layer is built. The linear layer (`fsdp_float8.nn.linear`) and
the expert projections (`fsdp_float8.experts.gemm`) both run on it; tensor parallelism
derives its plan from it (`reduced_over` its group where a cast spans a sharded dim).

Inside the autograd functions an operand is a `Pair` (data, scale): float8 data with its
scale, or (hp, None) for a high-precision GEMM; `weight_for` says once how a weight becomes
the pair of a GEMM (a gathered `Float8Tensor` used as it is, rows re-cast for grad_input).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

import torch

from fsdp_float8.core.config import Float8LinearConfig, ScalingGranularity
from fsdp_float8.core.float8_tensor import Float8Tensor
from fsdp_float8.core.gemms import GEMM_OPERANDS, GEMMS, PRIMARY_GEMM, SECOND_GEMM, Gemm, Operand
from fsdp_float8.core.payload import E8M0
from fsdp_float8.core.scaling import (
    Axiswise,
    DynamicScaling,
    Granularity,
    ScalingStrategy,
    Tensorwise,
)

CASTS: tuple[tuple[Operand, Gemm], ...] = tuple(
    (op, gemm) for gemm, ops in GEMM_OPERANDS.items() for op in ops
)
Pair = tuple[torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class CastPlan:
    """The resolved casts of one layer, computed once from its config."""

    strategies: dict[tuple[Operand, Gemm], ScalingStrategy | None]
    dtypes: dict[tuple[Operand, Gemm], torch.dtype]
    fast_accum: dict[Gemm, bool]
    emulate: bool
    pad_inner_dim: bool
    # rowwise float8 all-gather: the grad_input weight is re-cast from the row-cast weight,
    # sharded or not, so a model's numerics do not depend on how it is sharded
    weight_from_rows: bool
    # per GEMM: (left, right) operand blocks in the GEMM's frame (None: the scale
    # broadcasts) and the scale dtype the block GEMM gets (e8m0 for MX)
    blocks: dict[Gemm, tuple]
    scale_dtypes: dict[Gemm, torch.dtype]
    # a float8 grad_weight GEMM with row or block scales outputs in the activations' dtype
    # (CUDA row-wise GEMMs give bf16 only; an fp32 weight under autocast gets its bf16
    # result cast up, as torchao does); tensorwise and high precision: the weight's dtype
    row_scaled_grad_weight: bool

    @classmethod
    def from_config(cls, config: Float8LinearConfig) -> Self:
        return cls(
            strategies={k: config.strategy(*k) for k in CASTS},
            dtypes={k: config.float8_dtype(*k) for k in CASTS},
            fast_accum={g: config.gemm_config(g).use_fast_accum for g in GEMMS},
            emulate=config.emulate,
            pad_inner_dim=config.pad_inner_dim,
            weight_from_rows=config.enable_fsdp_float8_all_gather
            and config.cast(Operand.WEIGHT, Gemm.OUTPUT).scaling_granularity
            is ScalingGranularity.AXISWISE,
            blocks={g: _gemm_blocks(config, g) for g in GEMMS},
            scale_dtypes={
                g: config.cast(GEMM_OPERANDS[g][0], g).granularity().scale_dtype for g in GEMMS
            },
            row_scaled_grad_weight=_row_scaled(config, Gemm.GRAD_WEIGHT),
        )

    def high_precision(self, gemm: Gemm) -> bool:
        return self.strategies[(GEMM_OPERANDS[gemm][0], gemm)] is None

    def shares_cast(self, operand: Operand, first: Gemm, second: Gemm) -> bool:
        """True when the second use can reuse the first cast (same tensorwise scale, dtype)."""
        s1, s2 = self.strategies[(operand, first)], self.strategies[(operand, second)]
        # tensorwise or square blocks: the same cast whichever dim is contracted
        invariant = s1 is not None and s1.granularity.transpose_invariant
        same_dtype = self.dtypes[(operand, first)] == self.dtypes[(operand, second)]
        return invariant and s1 == s2 and same_dtype

    def shared(self, operand: Operand) -> bool:
        """The operand's primary cast serves its second GEMM too."""
        return self.shares_cast(operand, PRIMARY_GEMM[operand], SECOND_GEMM[operand])


def _row_scaled(config: Float8LinearConfig, gemm: Gemm) -> bool:
    cast = config.cast(GEMM_OPERANDS[gemm][0], gemm)
    return cast.enabled and cast.scaling_granularity is not ScalingGranularity.TENSORWISE


def block_cast(
    strategies: dict[tuple[Operand, Gemm], ScalingStrategy | None],
) -> tuple[Operand, Gemm, Granularity] | None:
    """The first float8 cast whose scale does not broadcast (a block scale), or None: what
    the GEMM families without a block GEMM (experts, tensor parallelism) refuse."""
    for (operand, gemm), strategy in strategies.items():
        if strategy is not None and not isinstance(strategy.granularity, (Tensorwise, Axiswise)):
            return operand, gemm, strategy.granularity
    return None


def _gemm_blocks(config: Float8LinearConfig, gemm: Gemm) -> tuple:
    """Blocks of the GEMM's operands in its frame: left (M, K) contracts dim 1, right (K, N)
    dim 0 (`Granularity.block`)."""
    left, right = GEMM_OPERANDS[gemm]
    return (
        config.cast(left, gemm).granularity().block(1),
        config.cast(right, gemm).granularity().block(0),
    )


# cast(hp, operand, gemm, plan, context) -> Pair: the family's own cast (the context is
# the linear's delayed states, or the experts' token offsets)
Cast = Callable[[torch.Tensor, Operand, Gemm, CastPlan, Any], Pair]


def weight_for(weight: torch.Tensor, gemm: Gemm, plan: CastPlan, cast: Cast, context) -> Pair:
    """The weight as the pair of `gemm`: a Float8Tensor from the FSDP2 float8 all-gather as
    it is (tensorwise or square blocks serve both weight GEMMs), else cast from hp; per-row
    scales suit the output GEMM only, so grad_input re-casts the row-cast weight. A gathered
    weight's operands that are not its data as it is are built once per unshard
    (`Float8Tensor._operands`)."""
    if isinstance(weight, Float8Tensor):  # pre-cast by the FSDP2 float8 all-gather
        kind = _gathered_kind(weight, gemm, plan)
        if kind == "as_is":
            return weight._data, weight._scale
        # under torch.compile the graph builds the operand (the record is not traced)
        cache = None if torch.compiler.is_compiling() else weight._operands
        if cache is None or kind == "cast":
            return gathered_operand(weight, gemm, kind, plan, cast, context, None)[0]
        return cache.operand(
            gemm, lambda out: gathered_operand(weight, gemm, kind, plan, cast, context, out)
        )
    if gemm is Gemm.GRAD_INPUT and plan.weight_from_rows:
        rows = cast(weight, Operand.WEIGHT, Gemm.OUTPUT, plan, context)
        return _grad_input_from_rows(rows, plan, cast, context)
    return cast(weight, Operand.WEIGHT, gemm, plan, context)


def _gathered_kind(weight: Float8Tensor, gemm: Gemm, plan: CastPlan) -> str:
    """How a gathered weight becomes `gemm`'s operand: 'as_is' (its data and scale), 'rows'
    (the same float8 data, column-major for grad_input: tensorwise or square blocks; MX
    scales swizzled on CUDA), 'columns' (a row-cast 2-D weight re-cast along N) or 'cast'
    (any other grad_input cast: from the dequantized weight)."""
    if gemm is Gemm.OUTPUT:
        return "rows" if _mx_on_cuda(weight, plan) else "as_is"
    if weight._scale.dim() == 0 or plan.shared(Operand.WEIGHT):
        # the block emulation takes any layout; a 3-D expert weight, its grouped GEMM's
        blocks_emulated = weight._block is not None and (plan.emulate or not weight.is_cuda)
        return "as_is" if blocks_emulated or weight._data.dim() != 2 else "rows"
    if weight._data.dim() != 2:
        return "cast"
    strategy = plan.strategies[(Operand.WEIGHT, Gemm.GRAD_INPUT)]
    if isinstance(strategy, DynamicScaling) and isinstance(
        strategy.granularity, (Tensorwise, Axiswise)
    ):
        return "columns"
    return "cast"


def _mx_on_cuda(weight: Float8Tensor, plan: CastPlan) -> bool:
    """An MX weight for the CUDA GEMM, which takes its e8m0 scales swizzled."""
    return (
        weight._block is not None
        and weight.is_cuda
        and not plan.emulate
        and plan.scale_dtypes[Gemm.OUTPUT] == E8M0
    )


def gathered_operand(
    weight: Float8Tensor,
    gemm: Gemm,
    kind: str,
    plan: CastPlan,
    cast: Cast,
    context,
    out: Pair | None,
) -> tuple[Pair, tuple[torch.Tensor, ...]]:
    """A gathered weight's operand of `gemm` in the layout its GEMM takes, written into
    `out`'s buffers when given (the operand of the previous unshard): (operand, buffers
    newly allocated). The values do not depend on `out`."""
    data, scale = weight._data, weight._scale
    if kind == "rows":
        new: tuple[torch.Tensor, ...] = ()
        if gemm is Gemm.GRAD_INPUT:  # the weight is the right operand: column-major
            columns = out[0].t() if out is not None else _empty_t(data)
            columns.copy_(data.t())
            data, new = columns.t(), (() if out is not None else (columns,))
        if not _mx_on_cuda(weight, plan):
            return (data, scale), new
        from fsdp_float8.core.blocks_cuda import swizzled_right_scale

        # the right operand's scale: W.t()'s for the output GEMM, W's for grad_input
        right = scale.t() if gemm is Gemm.OUTPUT else scale
        n = data.shape[0] if gemm is Gemm.OUTPUT else data.shape[1]
        swizzled = swizzled_right_scale(right, plan.blocks[gemm][1], n)
        if out is None:
            return (data, swizzled), (*new, swizzled)
        assert out[1] is not None
        out[1].copy_(swizzled)
        return (data, out[1]), new
    if kind == "columns":
        strategy = plan.strategies[(Operand.WEIGHT, Gemm.GRAD_INPUT)]
        assert isinstance(strategy, DynamicScaling)
        dtype = plan.dtypes[(Operand.WEIGHT, Gemm.GRAD_INPUT)]
        return _columns_from_rows(data, scale, strategy, dtype, out, _pow2_rows(plan))
    return _grad_input_from_rows((data, scale), plan, cast, context), ()


def _empty_t(data: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A row-major (K, N) buffer for an (N, K) weight's column-major copy."""
    return torch.empty(
        (data.shape[1], data.shape[0]), dtype=dtype or data.dtype, device=data.device
    )


def _grad_input_from_rows(rows: Pair, plan: CastPlan, cast: Cast, context) -> Pair:
    """The grad_input operand from a row-cast weight (sharded or not, so a model's numerics
    do not depend on how it is sharded)."""
    scale = rows[1]
    if scale is None or scale.dim() == 0 or plan.shared(Operand.WEIGHT):
        return rows
    # grad_input contracts over the rows: re-cast from the row-cast weight (no extra bytes
    # gathered; grad_input SQNR within ~0.1 dB (rowwise) / ~2.5 dB (tensorwise,
    # rowwise_with_gw_hp) of a cast from hp)
    strategy = plan.strategies[(Operand.WEIGHT, Gemm.GRAD_INPUT)]
    # a scale that broadcasts (tensorwise, per column): re-cast in place; blocks need
    # their own cast, from the dequantized weight
    if (
        rows[0].dim() == 2
        and isinstance(strategy, DynamicScaling)
        and isinstance(strategy.granularity, (Tensorwise, Axiswise))
    ):
        dtype = plan.dtypes[(Operand.WEIGHT, Gemm.GRAD_INPUT)]
        return _columns_from_rows(rows[0], scale, strategy, dtype, None, _pow2_rows(plan))[0]
    hp = rows[0].to(torch.float32)
    hp.mul_(scale.reciprocal())  # in place: the one float32 copy of the weight
    return cast(hp, Operand.WEIGHT, Gemm.GRAD_INPUT, plan, context)


def _pow2_rows(plan: CastPlan) -> bool:
    """Whether the weight's row scales (its output GEMM cast) are powers of two."""
    strategy = plan.strategies[(Operand.WEIGHT, Gemm.OUTPUT)]
    return isinstance(strategy, DynamicScaling) and strategy.power_of_2


def _columns_from_rows(
    data: torch.Tensor,
    row_scale: torch.Tensor,
    strategy: DynamicScaling,
    dtype: torch.dtype,
    out: Pair | None,
    pow2_rows: bool,
) -> tuple[Pair, tuple[torch.Tensor, ...]]:
    """A row-cast (N, K) weight re-cast along N for grad_input, in the GEMM's column-major
    layout: one float32 (K, N) buffer, dequantized, scaled and clamped in place, plus the
    amax's transient |x| (a bf16 weight cast from hp writes ~1.75 float32 weights' bytes).
    The same values as dequantize-then-`cast_operand` (elementwise ops, exact max). With
    `out`, the float8 columns are written into its buffer; the new buffers returned are the
    columns only (FSDP2 frees them with the weight), the K scales are kept as made."""
    hp_t = data.t().to(torch.float32, memory_format=torch.contiguous_format)
    if pow2_rows:  # x / s is x * (1 / s) exactly: one op
        hp_t.div_(row_scale.t())
    else:  # as the dequantization rounds
        hp_t.mul_(row_scale.reciprocal().t())
    scale = strategy.scale(hp_t, 1, dtype)  # (K, 1) or 0-d
    hp_t.mul_(scale)  # the scale of hp_t's own amax: no clamp (`cast_to_float8_data`)
    scale_t = scale.t() if scale.dim() == 2 else scale
    if out is None:
        columns = hp_t.to(dtype)
        return (columns.t(), scale_t), (columns,)
    columns = out[0].t()
    columns.copy_(hp_t)  # the cast to float8, as `.to(dtype)` rounds
    # the scale (K floats) is the fresh one: a copy into a kept buffer would be an op more
    return (out[0], scale_t), ()
