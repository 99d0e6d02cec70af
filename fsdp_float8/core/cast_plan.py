"""The cast plan: a layer's casts resolved once from its config, for every float8 GEMM family.

Mental model. A `Float8LinearConfig` says, in user words, how each operand is cast for each
of the three GEMMs; a `CastPlan` is that resolved into behaviour (a scaling strategy and a
float8 dtype per (operand, GEMM), fast accumulation per GEMM, the block shapes the GEMM
sees), computed once when a layer is built. The linear layer (`fsdp_float8.nn.linear`) and
the expert projections (`fsdp_float8.experts.gemm`) both run on it; tensor parallelism
derives its plan from it (`reduced_over` its group where a cast spans a sharded dim).

Inside the autograd functions an operand is a `Pair` (data, scale): float8 data with its
scale, or (hp, None) for a high-precision GEMM; `fsdp_float8.formats.weight_operands` says
how a weight becomes the pair of a GEMM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

import torch

from fsdp_float8.core.config import Float8LinearConfig
from fsdp_float8.core.gemms import GEMM_OPERANDS, GEMMS, PRIMARY_GEMM, SECOND_GEMM, Gemm, Operand
from fsdp_float8.core.scaling import DynamicScaling, Granularity, ScalingStrategy

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
    # layers reading one input share its casts (`Float8LinearConfig.share_input_casts`)
    share_input_casts: bool = False

    def __post_init__(self) -> None:
        # `shared(operand)`, answered once per plan: each GEMM asks it
        shared = frozenset(
            op for op in PRIMARY_GEMM if self.shares_cast(op, PRIMARY_GEMM[op], SECOND_GEMM[op])
        )
        object.__setattr__(self, "_shared", shared)

    @classmethod
    def from_config(cls, config: Float8LinearConfig) -> Self:
        return cls(
            strategies={k: config.strategy(*k) for k in CASTS},
            dtypes={k: config.float8_dtype(*k) for k in CASTS},
            fast_accum={g: config.gemm_config(g).use_fast_accum for g in GEMMS},
            emulate=config.emulate,
            pad_inner_dim=config.pad_inner_dim,
            weight_from_rows=config.enable_fsdp_float8_all_gather
            and config.cast(Operand.WEIGHT, Gemm.OUTPUT).scaling_granularity.family.per_row,
            blocks={g: _gemm_blocks(config, g) for g in GEMMS},
            scale_dtypes={
                g: config.cast(GEMM_OPERANDS[g][0], g).granularity().scale_dtype for g in GEMMS
            },
            row_scaled_grad_weight=_row_scaled(config, Gemm.GRAD_WEIGHT),
            share_input_casts=config.share_input_casts,
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
        return operand in self._shared  # type: ignore[attr-defined]  # set in __post_init__

    def joint_output_cast(self) -> bool:
        """The output GEMM's input and weight are both cast with the dynamic tensorwise
        scale of their own amax, to one float8 dtype, with no reduction over a group: the
        two casts can run as one (the family's `joint_cast`, in `fsdp_float8.formats`)."""
        x = self.strategies[(Operand.INPUT, Gemm.OUTPUT)]
        w = self.strategies[(Operand.WEIGHT, Gemm.OUTPUT)]
        return (
            isinstance(x, DynamicScaling)
            and isinstance(w, DynamicScaling)
            and _one_scale(x.granularity)
            and _one_scale(w.granularity)
            and x.group is None
            and w.group is None
            and self.dtypes[(Operand.INPUT, Gemm.OUTPUT)]
            == self.dtypes[(Operand.WEIGHT, Gemm.OUTPUT)]
        )


def _one_scale(granularity: Granularity) -> bool:
    """One scale for the whole operand: its scale's amax needs the whole tensor."""
    return granularity.family.needs_global_amax


def _row_scaled(config: Float8LinearConfig, gemm: Gemm) -> bool:
    cast = config.cast(GEMM_OPERANDS[gemm][0], gemm)
    return cast.enabled and not cast.scaling_granularity.family.needs_global_amax


def block_cast(
    strategies: dict[tuple[Operand, Gemm], ScalingStrategy | None],
) -> tuple[Operand, Gemm, Granularity] | None:
    """The first float8 cast whose scale does not broadcast (a block scale), or None: what
    the GEMM families without a block GEMM (experts, tensor parallelism) refuse."""
    for (operand, gemm), strategy in strategies.items():
        if strategy is not None and not strategy.granularity.broadcast_scales:
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
