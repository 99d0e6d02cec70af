"""Float8 expert projections: the three GEMMs of E linear layers at once, tokens grouped.

Mental model: an expert projection is a stack of E linear layers, one 3-D weight
`(E, out, in)` whose `weight[e]` is expert e's `nn.Linear` weight. The tokens come already
permuted by expert with offsets (`fsdp_float8.experts.grouped_mm`), so expert parallelism (an
all-to-all dispatch in front) can come later without touching this. Per expert, the GEMMs
are the linear layer's (`linear.py`, same words):

    output[g]      = input[g] @ weight[e].T        contracts over in
    grad_input[g]  = grad_output[g] @ weight[e]    contracts over out
    grad_weight[e] = grad_output[g].T @ input[g]   contracts over expert e's tokens

One autograd function runs them, cast as a `Float8LinearConfig` says (recipes `rowwise`,
`tensorwise`, `rowwise_with_gw_hp`; dynamic scaling only). Rowwise scales follow each
GEMM's contraction dim: per token row for input and grad_output in the first two GEMMs; per
expert output row `(E, out, 1)` for the weight in output and `(E, 1, in)` in grad_input; per
expert and column for the grad_weight operands. A weight that arrives as a `Float8Tensor`
(the FSDP2 float8 all-gather of `weight_wrappers`, per-row scales local to each expert) is
used as it is; as in `linear.py`, with rowwise float8 all-gather the grad_input weight is
re-cast from the row-cast weight, sharded or not.
"""

from __future__ import annotations

from typing import Self

import torch

from fsdp_float8.core.cast_plan import CASTS, CastPlan, Pair, block_cast
from fsdp_float8.core.config import Float8LinearConfig
from fsdp_float8.core.families import broadcasting, recipe_where, recipes_where, scaled_per_row
from fsdp_float8.core.gemms import CONTRACTION_DIM, Gemm, Operand, refuse_double_backward
from fsdp_float8.core.input_casts import shared_casts, shared_grad_weight
from fsdp_float8.core.scaling import DynamicScaling, cast_to_float8_data
from fsdp_float8.experts.grouped_mm import (
    group_column_amax,
    grouped_mm_hp,
    grouped_scaled_mm,
    per_row,
)
from fsdp_float8.formats.weight_operands import weight_for

GROUPS = "groups"  # the grad_weight operands: per expert, along its tokens
# the dim each cast reduces over: the linear's (`CONTRACTION_DIM`) counted from the end,
# since the weight (E, N, K) gains a leading expert dim (tokens stay (M, K), grad_output
# (M, N)); the grad_weight operands reduce per expert, along its tokens
EXPERT_SCALE_DIM: dict[tuple[Operand, Gemm], int | str] = {
    (op, gemm): GROUPS if gemm is Gemm.GRAD_WEIGHT else (dim - 2 if dim >= 0 else dim)
    for (gemm, op), dim in CONTRACTION_DIM.items()
}


class ExpertCastPlan(CastPlan):
    """The linear's `CastPlan`, built after the checks that expert GEMMs need."""

    @classmethod
    def from_config(cls, config: Float8LinearConfig) -> Self:
        check_expert_config(config)
        return super().from_config(config)


def check_expert_config(config: Float8LinearConfig) -> None:
    """Expert GEMMs scale dynamically (tensorwise or rowwise): refuse the rest up front."""
    strategies = {(op, gemm): config.strategy(op, gemm) for op, gemm in CASTS}
    blocked = block_cast(strategies)
    if blocked is not None:
        op, gemm, granularity = blocked
        raise ValueError(
            f"block-scaled float8 expert GEMMs are not supported yet; {op.value} for "
            f"{gemm.value} has {granularity}. Give the experts a "
            f"{recipes_where(broadcasting)} recipe: convert_to_float8_training(model, "
            "config=..., expert_config="
            f"Float8LinearConfig.from_recipe_name({recipe_where(scaled_per_row)!r}))"
        )
    for (op, gemm), strategy in strategies.items():
        if strategy is not None and not isinstance(strategy, DynamicScaling):
            raise ValueError(
                f"float8 expert GEMMs scale dynamically only; {op.value} for {gemm.value} is "
                f"{config.cast(op, gemm).scaling_type.value}. Use a dynamic recipe for the "
                f"experts ({recipes_where(broadcasting, 'or')}), e.g. "
                "convert_to_float8_training(model, config=..., expert_config="
                f"Float8LinearConfig.from_recipe_name({recipe_where(scaled_per_row)!r}))"
            )


def cast_expert_operand(hp, op: Operand, gemm: Gemm, plan: CastPlan, offs) -> Pair:
    """(float8 data, scale) of one operand for one GEMM; (hp, None) for a high-precision
    GEMM. Grad_weight operands get per-(expert, column) scales (E, C) when rowwise."""
    strategy = plan.strategies[(op, gemm)]
    if strategy is None:
        return hp, None
    dtype, dim = plan.dtypes[(op, gemm)], EXPERT_SCALE_DIM[(op, gemm)]
    if not isinstance(dim, int) and isinstance(strategy, DynamicScaling):
        if strategy.granularity.per_row:  # per (expert, column)
            scale = strategy.scale_from_amax(group_column_amax(hp, offs), dtype)
            return cast_to_float8_data(hp, per_row(scale, offs, hp.shape[0]), dtype), scale
    scale = strategy.scale(hp, dim if isinstance(dim, int) else -1, dtype)
    return cast_to_float8_data(hp, scale, dtype), scale


def expert_weight_for(weight, gemm: Gemm, plan: CastPlan, offs) -> Pair:
    """The weight (E, N, K) cast for `gemm` (`formats.weight_operands.weight_for`: a
    gathered Float8Tensor as it is for output, its rows re-cast along `out` for grad_input
    when rowwise)."""
    return weight_for(weight, gemm, plan, cast_expert_operand, offs)


def _t3(pair: Pair) -> Pair:
    data, scale = pair
    scale = scale.transpose(-2, -1) if scale is not None and scale.dim() == 3 else scale
    return data.transpose(-2, -1), scale


def _gemm(left: Pair, right: Pair, offs, gemm: Gemm, plan: CastPlan, out_dtype):
    (a, a_scale), (b, b_scale) = left, right
    if a_scale is None or b_scale is None:  # both or neither (the config checks)
        return grouped_mm_hp(a, b, offs, out_dtype)
    return grouped_scaled_mm(
        a,
        a_scale,
        b,
        b_scale,
        offs,
        out_dtype=out_dtype,
        emulate=plan.emulate,
        use_fast_accum=plan.fast_accum[gemm],
        pad_inner_dim=plan.pad_inner_dim,
    )


class _Float8GroupedExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offs, plan: CastPlan):
        x_fp8 = cast_expert_operand(x, Operand.INPUT, Gemm.OUTPUT, plan, offs)
        w_fp8 = expert_weight_for(weight, Gemm.OUTPUT, plan, offs)
        out = _gemm(x_fp8, _t3(w_fp8), offs, Gemm.OUTPUT, plan, x.dtype)
        ctx.save_for_backward(x, weight, offs)
        # w1 and w3 read the same tokens: one grad_weight cast of them (`input_casts`)
        ctx.plan, ctx.record = plan, shared_casts(x, plan, offs)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, offs = ctx.saved_tensors
        refuse_double_backward("float8 grouped experts GEMM", weight.shape)
        plan = ctx.plan
        grad_out = grad_out.contiguous()  # an expanded gradient (sum()) has stride 0
        go = cast_expert_operand(grad_out, Operand.GRAD_OUTPUT, Gemm.GRAD_INPUT, plan, offs)
        w_gi = expert_weight_for(weight, Gemm.GRAD_INPUT, plan, offs)
        grad_x = _gemm(go, w_gi, offs, Gemm.GRAD_INPUT, plan, grad_out.dtype)
        go_gw = cast_expert_operand(grad_out, Operand.GRAD_OUTPUT, Gemm.GRAD_WEIGHT, plan, offs)
        record, ctx.record = ctx.record, None  # held until the last reader's backward
        x_gw = shared_grad_weight(
            record, lambda: cast_expert_operand(x, Operand.INPUT, Gemm.GRAD_WEIGHT, plan, offs)
        )
        go_t = (go_gw[0].t(), go_gw[1])  # (N, M) with its per-(expert, row) scale (E, N)
        # row-scaled: the activations' dtype, cast up (the grouped kernel gives bf16 only)
        gw_dtype = grad_out.dtype if plan.row_scaled_grad_weight else weight.dtype
        grad_w = _gemm(go_t, x_gw, offs, Gemm.GRAD_WEIGHT, plan, gw_dtype).to(weight.dtype)
        return grad_x, grad_w, None, None


def float8_grouped_mm(
    x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, plan: CastPlan
) -> torch.Tensor:
    """`x (M, in)` grouped by `offs` times each expert's `weight[e].T`: `(M, out)`, in
    float8 as `plan` says, differentiable in x and weight."""
    _check_operands(x, weight, offs)
    device = x.device.type
    if torch.is_autocast_enabled(device):  # as Float8Linear: GEMMs in the autocast dtype
        x = x.to(torch.get_autocast_dtype(device))
    with torch.autocast(device, enabled=False):
        return _Float8GroupedExpertsFn.apply(x, weight, offs, plan)


def _check_operands(x, weight, offs) -> None:
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(
            f"float8_grouped_mm takes tokens (M, in) and an expert weight (E, out, in), got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}; flatten the tokens and pass the "
            "3-D weight in the nn.Linear layout (out, in) per expert"
        )
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.numel() != weight.shape[0]:
        raise ValueError(
            f"offs must be a 1-D int32 tensor of {weight.shape[0]} cumulative token counts "
            f"(one per expert), got {offs.dtype} of shape {tuple(offs.shape)}; build it as "
            "torch.cumsum(tokens_per_expert, 0).to(torch.int32)"
        )
    if not offs.is_cuda and offs.numel() and int(offs[-1]) != x.shape[0]:  # no sync on CPU
        raise ValueError(
            f"offs ends at {int(offs[-1])} but there are {x.shape[0]} token rows; every token "
            "row must belong to an expert (permute the routed tokens, then pass their counts)"
        )
