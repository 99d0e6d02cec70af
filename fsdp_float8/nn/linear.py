"""Float8Linear: a drop-in nn.Linear whose three GEMMs run in float8.

One autograd function runs them all. Each operand is cast once per GEMM it enters, as
`Float8LinearConfig` says (a cast shared by two GEMMs is done once and transposed); a
disabled cast leaves that GEMM in high precision. A weight that arrives already as a
`Float8Tensor` (the FSDP2 float8 all-gather) is used as it is, in forward and backward;
so is an input (tensor parallel's float8 all-gather of a sequence-parallel activation).
Under tensor parallelism the weight is a DTensor and the layer runs on local tensors
(`fsdp_float8.tensor_parallel.styles`).

Memory: backward keeps the weight parameter itself (FSDP2 frees and re-gathers it around
backward as it does for bf16) and the input: in float8 where grad_weight takes the
forward's input cast as it is (tensorwise: the same scale and bytes), else in high
precision, or its grad_weight cast with `save_input_in_float8=True`.

Compiled, a dynamic tensorwise layer with a plain weight (no float8 all-gather) casts its
input and weight as one (its family's `joint_cast`: one amax reduction and one cast pass
for both, three GPU kernels instead of six); backward then takes the weight's float8
column-major copy from the forward instead of casting the weight again, so it keeps
N x K bytes more (the weight in float8) until the layer's backward.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.nn import functional as F

from fsdp_float8.core.cast_plan import CastPlan, Pair
from fsdp_float8.core.config import Float8LinearConfig, ScalingType, as_float8_linear_config
from fsdp_float8.core.delayed_state import DelayedScalingState, is_training_forward
from fsdp_float8.core.float8_tensor import Float8Tensor
from fsdp_float8.core.gemm import check_float8_gemm_device, high_precision_mm, scaled_mm_data
from fsdp_float8.core.gemms import (
    CONTRACTION_DIM,
    PRIMARY_GEMM,
    SECOND_GEMM,
    Gemm,
    Operand,
    refuse_double_backward,
)
from fsdp_float8.core.input_casts import shared_casts, shared_grad_weight
from fsdp_float8.formats.tensorwise import columns_from_row_scales, from_row_scales
from fsdp_float8.formats.weight_operands import joint_place, weight_for
from fsdp_float8.nn.cast_words import cast_configs
from fsdp_float8.nn.layer import QuantizedLinear
from fsdp_float8.nn.linear_checks import (
    check_dims,
    check_input_dtype,
    local_parameters,
    quantized_elsewhere,
    refuse_dtype_mismatch,
    require_float8_weight,
)
from fsdp_float8.weight_wrappers.base import Float8WeightWrapper


def cast_operand(hp, operand, gemm, plan: CastPlan, states: dict) -> Pair:
    """Cast a 2-D operand for one GEMM; (hp, None) when that GEMM is high precision."""
    strategy = plan.strategies[(operand, gemm)]
    if strategy is None:
        return hp, None
    dtype, dim = plan.dtypes[(operand, gemm)], CONTRACTION_DIM[(gemm, operand)]
    scale = strategy.scale(hp, dim, dtype, states.get(operand))
    # an operand's second GEMM takes it column-major (grad_input's weight, grad_weight's
    # input and grad_output.T): the cast lays it out so, no transposed copy afterwards
    column_major = gemm is SECOND_GEMM[operand]
    saturate = not strategy.own_amax  # else the scale's amax covers hp: no clamp needed
    data = strategy.granularity.cast(
        hp, scale, dim, dtype, column_major=column_major, saturate=saturate
    )
    return data, scale


def _t(pair: Pair) -> Pair:
    data, scale = pair
    return data.t(), (scale.t() if scale is not None and scale.dim() == 2 else scale)


def _inverse_of(scale: torch.Tensor | None, states: dict) -> torch.Tensor | None:
    """`1 / scale` of a 0-d (tensorwise) scale, what `torch._scaled_mm` takes; None for any
    other scale (the GEMM divides those itself). Computed once per operand cast: the inverse
    travels beside its cast through forward and backward (x's serves output and
    grad_weight, grad_output's grad_input and grad_weight). A synced delayed scale (the
    state's own buffer, `DelayedState.ready`) has its inverse made at the sync: no op."""
    if scale is None or scale.dim() != 0:
        return None
    for state in states.values():
        if state.ready and scale is state.scale:
            return state.inverse
    return scale.reciprocal()


def _weight_inverse(weight, scale: torch.Tensor | None, states: dict) -> torch.Tensor | None:
    """The inverse of a weight operand's scale: a gathered tensorwise or rowwise weight
    brought its own with the all-gather (`Float8Tensor._inverse`, a graph input when
    compiled), so no op per GEMM; else `_inverse_of`."""
    inverse = weight._inverse if isinstance(weight, Float8Tensor) else None
    if inverse is not None and scale is weight._scale:  # the gathered scale itself
        return inverse
    return _inverse_of(scale, states)


Inverses = tuple[torch.Tensor | None, torch.Tensor | None]


def _gemm(
    left: Pair, right: Pair, gemm: Gemm, plan: CastPlan, out_dtype, inverses: Inverses
) -> torch.Tensor:
    (a, a_scale), (b, b_scale) = left, right
    if a_scale is None or b_scale is None:  # both or neither (the config checks)
        return high_precision_mm(a, b, out_dtype)
    return scaled_mm_data(
        a,
        a_scale,
        b,
        b_scale,
        out_dtype=out_dtype,
        emulate=plan.emulate,
        use_fast_accum=plan.fast_accum[gemm],
        # the token dim (contraction of grad_weight) is not the user's to choose: always pad
        pad_inner_dim=plan.pad_inner_dim or gemm is Gemm.GRAD_WEIGHT,
        blocks=plan.blocks[gemm],
        scale_dtype=plan.scale_dtypes[gemm],
        inv_scales=inverses,  # each operand's own `1 / scale` where it has one
    )


# where a compiled layer casts input and weight as one: on a GPU it saves launches (three
# kernels for six, `joint_cast`); CPU Inductor lowers the stacked form into more loop nests
# than the separate casts (38 kernels against 30 for the SwiGLU block of `count_kernels`)
JOINT_CAST_DEVICES = ("cuda",)
_JOINT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _joint(x2: torch.Tensor, weight: torch.Tensor, plan: CastPlan) -> bool:
    """Whether the output GEMM's input and weight casts run as one (`joint_cast`): in a
    compiled graph on a GPU (eager, the stacked copy would cost a pass of its own), for a plain
    high-precision weight (not a gathered one), both of them 16- or 32-bit floats (stacked in
    the wider dtype, which holds both exactly: a float32 weight under autocast), with static
    shapes whose dims are multiples of 16."""
    return (
        torch.compiler.is_compiling()
        and x2.device.type in JOINT_CAST_DEVICES
        and plan.joint_output_cast()
        and not isinstance(weight, (Float8Tensor, Float8WeightWrapper))
        and x2.dtype in _JOINT_DTYPES
        and weight.dtype in _JOINT_DTYPES
        # static shapes only (known without a guard): at a dynamic-shape recompile torch
        # 2.11's Dynamo fails on views at symbolic offsets (separate casts: the same bytes)
        and statically_known_true(x2.shape[0] > 0)
        and all(statically_known_true(d % 16 == 0) for d in (*x2.shape, *weight.shape))
    )


def joint_cast(x2: torch.Tensor, weight: torch.Tensor, plan: CastPlan):
    """The output GEMM's input and weight cast as one, by their family's place (its
    `JointCast`)."""
    return joint_place(plan).joint_cast(x2, weight, plan)


def _weight_for(weight, gemm: Gemm, plan: CastPlan, states: dict) -> Pair:
    return weight_for(weight, gemm, plan, cast_operand, states)


class _Float8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, plan: CastPlan, states: dict, save_input_in_float8: bool):
        x_fp8: Pair
        saved_x: Pair
        record, x_inv = None, None
        joint = None  # the place's `JointCast`
        if isinstance(x, Float8Tensor):  # pre-cast (tensor parallel's float8 all-gather)
            x_fp8 = saved_x = (x._data.reshape(-1, x.shape[-1]), x._scale)
        else:
            x2 = x.reshape(-1, x.shape[-1])
            record = shared_casts(x, plan)  # what the layers that read x share
            if record is not None and record.forward is not None:
                x_fp8, x_inv = record.forward, record.inverse
            elif record is None and _joint(x2, weight, plan):
                joint = joint_cast(x2, weight, plan)
                x_fp8 = joint.x
            else:
                x_fp8 = cast_operand(x2, Operand.INPUT, Gemm.OUTPUT, plan, states)
            saved_x = (x2, None)
            if plan.shared(Operand.INPUT):
                # grad_weight takes the same cast (same scale, same bytes): keep the float8
                # input, not the hp one (half the memory; backward re-lays it out, one copy)
                saved_x = x_fp8 if joint is None else (joint.columns, x_fp8[1])
                if record is not None:
                    record.forward = x_fp8
            elif save_input_in_float8:  # blocks: tiles along the token dim, cast from hp
                saved_x = cast_operand(x2, Operand.INPUT, Gemm.GRAD_WEIGHT, plan, states)
        w_fp8 = joint.w if joint is not None else _weight_for(weight, Gemm.OUTPUT, plan, states)
        if x_inv is None:
            x_inv = _inverse_of(x_fp8[1], states)
        w_inv = _weight_inverse(weight, w_fp8[1], states)
        out = _gemm(x_fp8, _t(w_fp8), Gemm.OUTPUT, plan, x.dtype, (x_inv, w_inv))
        # the forward's scales (0-d or tiny) let backward re-cast a shared tensorwise cast
        # without another amax pass, and without recording delayed amaxes twice
        # (not a gathered Float8Tensor's scale: FSDP2 refreshes it in place on re-gather)
        w_scale = None if isinstance(weight, Float8Tensor) else w_fp8[1]
        # a plain weight's row scales give its one grad_input scale (`from_row_scales`)
        ctx.row_scales = joint is None and from_row_scales(weight, plan)
        if record is not None and record.forward is not None:
            record.inverse = x_inv
        ctx.save_for_backward(*saved_x, weight, x_fp8[1], w_scale, x_inv)
        # a joint cast's column buffer (saved as x's data) holds both backward operands
        ctx.joint = joint is not None and plan.shared(Operand.INPUT)
        ctx.plan, ctx.states, ctx.record = plan, states, record
        # _unsafe_view: the same data, but not an autograd view (FSDP2 warns on view outputs)
        return torch.ops.aten._unsafe_view(out, (*x.shape[:-1], out.shape[-1]))

    @staticmethod
    def backward(ctx, grad_out):
        x_data, x_saved_scale, weight, x_scale, w_scale, x_inv = ctx.saved_tensors
        w_col = None
        if ctx.joint:  # x_data is the joint cast's columns: both operands column-major
            tokens = grad_out.numel() // grad_out.shape[-1]
            x_data, w_col = joint_place(ctx.plan).joint_columns(x_data, tokens, weight.shape[1])
        refuse_double_backward("Float8Linear", weight.shape)
        plan, states = ctx.plan, ctx.states
        record, ctx.record = ctx.record, None  # held until the last reader's backward
        go2 = grad_out.reshape(-1, grad_out.shape[-1])
        go_fp8 = cast_operand(go2, Operand.GRAD_OUTPUT, Gemm.GRAD_INPUT, plan, states)
        w_inv = None
        if w_col is not None and plan.shared(Operand.WEIGHT):
            w_gi = (w_col, w_scale)
        elif ctx.row_scales:
            w_gi, w_inv = columns_from_row_scales(weight, w_scale, plan)
        elif isinstance(weight, Float8Tensor) or not plan.shared(Operand.WEIGHT):
            w_gi = _weight_for(weight, Gemm.GRAD_INPUT, plan, states)
        else:
            w_gi = _recast(weight, w_scale, Operand.WEIGHT, plan)
        go_inv = _inverse_of(go_fp8[1], states)
        if w_inv is None:
            w_inv = _weight_inverse(weight, w_gi[1], states)
        grad_x = _gemm(go_fp8, w_gi, Gemm.GRAD_INPUT, plan, grad_out.dtype, (go_inv, w_inv))
        if plan.shared(Operand.GRAD_OUTPUT):
            go_gw, go_gw_inv = go_fp8, go_inv
        else:
            go_gw = cast_operand(go2, Operand.GRAD_OUTPUT, Gemm.GRAD_WEIGHT, plan, states)
            go_gw_inv = None
        # a shared input cast keeps the forward's scale (saved or re-cast): its inverse too
        x_gw_inv = x_inv if plan.shared(Operand.INPUT) else None
        # grad_weight's input: made once for the layers that read it (`input_casts`)
        if x_saved_scale is not None:  # saved in float8 (shared, or save_input_in_float8)
            x_gw = shared_grad_weight(
                record, lambda: (_column_major(x_data), x_saved_scale)
            )  # column-major, as the GEMM lays it out
        elif plan.shared(Operand.INPUT):
            x_gw = _recast(x_data, x_scale, Operand.INPUT, plan)
        else:
            x_gw = shared_grad_weight(
                record,
                lambda: cast_operand(x_data, Operand.INPUT, Gemm.GRAD_WEIGHT, plan, states),
            )
        gw_dtype = grad_out.dtype if plan.row_scaled_grad_weight else weight.dtype
        grad_w = _gemm(_t(go_gw), x_gw, Gemm.GRAD_WEIGHT, plan, gw_dtype, (go_gw_inv, x_gw_inv))
        grad_w = grad_w.to(weight.dtype)
        # x's shape from grad_out's (no shape kept on ctx: a symbolic one there breaks torch
        # 2.11's Dynamo on a dynamic-shape recompile)
        grad_x = grad_x.reshape(*grad_out.shape[:-1], grad_x.shape[-1])
        return grad_x, grad_w, None, None, None


def _column_major(data: torch.Tensor) -> torch.Tensor:
    """`data` (2-D) laid out column-major: as it is when it is already (a joint cast's
    column buffer), else a transposed copy."""
    if data.stride(0) == 1 and data.shape[1] > 1:
        return data
    return data.t().contiguous().t()


def _recast(hp: torch.Tensor, scale: torch.Tensor, operand: Operand, plan: CastPlan) -> Pair:
    """The same cast as in forward (same tensorwise scale and dtype), without a new amax,
    laid out column-major for the operand's second GEMM (see `cast_operand`)."""
    gemm = PRIMARY_GEMM[operand]
    strategy = plan.strategies[(operand, gemm)]
    assert strategy is not None  # a shared cast is a float8 cast
    dim, dtype = CONTRACTION_DIM[(gemm, operand)], plan.dtypes[(operand, gemm)]
    saturate = not strategy.own_amax  # else the forward's amax was hp's
    data = strategy.granularity.cast(hp, scale, dim, dtype, column_major=True, saturate=saturate)
    return data, scale


class Float8Linear(QuantizedLinear):
    """nn.Linear with float8 GEMMs. Build it with `from_float` (shares the parameters) or
    `convert_to_float8_training`. `from_float`, `wrap_weight_for_fsdp`, the state-dict
    hooks and `float8_weight_names` are every quantized linear's (`QuantizedLinear`)."""

    # set by the float8 tensor-parallel styles (`fsdp_float8.tensor_parallel.styles`)
    tensor_parallel: object | None = None
    config: Float8LinearConfig

    def __init__(self, *args, config: Float8LinearConfig | None = None, **kwargs):
        super().__init__(*args, config=config, **kwargs)

    @classmethod
    def layer_config(cls, config) -> Float8LinearConfig:
        return as_float8_linear_config(config)

    @classmethod
    def check_device(cls, device: torch.device, config: Float8LinearConfig) -> None:
        check_float8_gemm_device(device, emulate=config.emulate)

    def prepare(self) -> None:
        check_dims(self.in_features, self.out_features, self.config)
        if self.weight.device.type == "cuda":  # from_float checks its meta-built layers
            self.check_device(self.weight.device, self.config)
        self.plan = CastPlan.from_config(self.config)
        # before the weight is wrapped: a delayed float8-gathered weight's scale source
        self.delayed_scaling = DelayedScalingState.for_config(self.config, self.weight.device)

    # torchao's Float8Linear attributes, read by code written for it (its tensor-parallel
    # styles check that input and grad_output are dynamically scaled)
    @property
    def scaling_type_input(self) -> ScalingType:
        return self.config.cast_config_input.scaling_type

    @property
    def scaling_type_weight(self) -> ScalingType:
        return self.config.cast_config_weight.scaling_type

    @property
    def scaling_type_grad_output(self) -> ScalingType:
        return self.config.cast_config_grad_output.scaling_type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        gathered = type(weight) is Float8Tensor  # the FSDP2 float8 all-gather's: no checks
        if not gathered and quantized_elsewhere(weight):  # e.g. torchao's quantize_: its GEMM
            return F.linear(x, weight, bias)
        if isinstance(weight, DTensor):  # tensor parallel: local GEMMs (tensor_parallel/)
            weight, bias = local_parameters(self, x)
        if self.config.enable_fsdp_float8_all_gather and not gathered:
            require_float8_weight(weight)
        if not x.dtype.is_floating_point or x.dtype.itemsize == 1:
            check_input_dtype(x)
        if torch.is_autocast_enabled(x.device.type):
            if not isinstance(x, Float8Tensor):
                x = x.to(torch.get_autocast_dtype(x.device.type))
        elif x.dtype != weight.dtype:
            refuse_dtype_mismatch(x.dtype, weight.dtype)
        with torch.autocast(x.device.type, enabled=False):
            delayed = self.delayed_scaling
            states = {}
            if delayed is not None:  # a pre-cast input is not recorded: counted apart
                states = delayed.views(is_training_forward(self), type(x) is not Float8Tensor)
            out = _Float8LinearFn.apply(
                x, weight, self.plan, states, self.config.save_input_in_float8
            )
            if bias is not None:
                out = out + bias.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        """torchao's: `..., cast_configs=i:dyn_ten_e4m3,w:dyn_ten_e4m3,go:dyn_ten_e5m2`,
        then i_gw / w_gi / go_gw for a second use cast otherwise (`cast_words`)."""
        c = self.config
        fsdp = ", fsdp_float8_all_gather=True" if c.enable_fsdp_float8_all_gather else ""
        return f"{super().extra_repr()}, cast_configs={cast_configs(c)}{fsdp}"
