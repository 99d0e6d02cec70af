"""Float8 all-gather of sequence-parallel activations: `PrepareFloat8ModuleInput`.

Mental model. On the module that feeds colwise layers (attention, the MLP) the activation
arrives sharded on the sequence dim (high precision, from a sequence-parallel norm). This
style casts each rank's shard to float8 with the scale of the *whole* activation (tensorwise:
the local amax all-reduced over the TP group, MAX; or a static scale), all-gathers the float8
bytes (1 byte per element, as uint8: gloo has no float8) and hands the consumers a
`DTensor(Float8Tensor, Replicate)`. Every consumer uses those bytes as its input cast for
both of its GEMMs, so the cast must be the consumers' own: tensorwise, shared by the output
and grad_weight GEMMs, in `float8_dtype`; anything else is refused at `parallelize_module`
time with the remedy (`PrepareModuleInput` gathers in high precision).

A sequence length the TP degree does not divide is gathered as DTensor shards it (the
first shards one token longer): each shard is padded to the longest for the collective and
the padding cut after, as the high-precision gather does.

Backward: the consumers' partial grad_inputs (DTensor `Partial`) are summed by autograd and
reduce-scattered back to the sequence shards in high precision.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput

from fsdp_float8.core._compat import all_gather_single
from fsdp_float8.core.cast_plan import CastPlan
from fsdp_float8.core.families import granularities_where, one_scale, recipes_where
from fsdp_float8.core.float8_tensor import Float8Tensor
from fsdp_float8.core.gemms import Gemm, Operand
from fsdp_float8.core.scaling import DynamicScaling, cast_to_float8_data
from fsdp_float8.nn.linear import Float8Linear
from fsdp_float8.tensor_parallel.styles import check_tp_config

_ONE = granularities_where(one_scale)  # the input cast this style gathers: one scale


class _Float8SPAllGather(torch.autograd.Function):
    """hp sequence shard -> DTensor(Float8Tensor, Replicate): cast with the scale of the
    whole activation (amax all-reduced over TP), all-gather 1 byte per element. Backward:
    reduce-scatter the high-precision gradient back to the sequence shards."""

    @staticmethod
    def forward(ctx, hp, mesh: DeviceMesh, seq_dim: int, length, strategy, float8_dtype, emulate):
        ctx.mesh, ctx.seq_dim = mesh, seq_dim
        scale = strategy.scale(hp, -1, float8_dtype)
        data = cast_to_float8_data(hp, scale, float8_dtype).view(torch.uint8)
        # gloo has no float8: the bytes travel as uint8 (the same bytes on NCCL), gathered
        # along dim 0, so the sequence dim goes first for the collective and back after
        local = data.movedim(seq_dim, 0)
        chunk = local.shape[0] if length is None else -(-length // mesh.size())
        if local.shape[0] < chunk:  # an uneven shard: padded to the first shards' size
            pad = local.new_zeros((chunk - local.shape[0], *local.shape[1:]))
            local = torch.cat([local, pad])
        local = local.contiguous()
        gathered = local.new_empty((mesh.size() * chunk, *local.shape[1:]))
        all_gather_single(gathered, local, mesh.get_group())
        if length is not None:  # DTensor's Shard: full chunks first, so the tokens lead
            gathered = gathered[:length]
        gathered = gathered.movedim(0, seq_dim).contiguous().view(float8_dtype)
        fp8 = Float8Tensor(gathered, scale, hp.dtype, emulate)
        return DTensor.from_local(fp8, mesh, (Replicate(),), run_check=False)

    @staticmethod
    def backward(ctx, grad):
        if not isinstance(grad, DTensor):  # a consumer outside the TP styles: a partial sum
            grad = DTensor.from_local(grad, ctx.mesh, (Partial(),), run_check=False)
        local = grad.redistribute(ctx.mesh, (Shard(ctx.seq_dim),)).to_local()
        return local, None, None, None, None, None, None


class PrepareFloat8ModuleInput(PrepareModuleInput):
    """torch's PrepareModuleInput (same arguments, plus torchao's `float8_dtype` and
    `fwd_config_submodule_fqn`): an input going from `Shard(d)` to `Replicate()` is cast to
    float8 before the all-gather; other inputs are redistributed in high precision.

    The cast is the one the consuming colwise layers would do (tensorwise, dynamic or
    static, from their config): `fwd_config_submodule_fqn` names one, else every
    Float8Linear below the module must cast its input alike."""

    def __init__(
        self,
        *,
        input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_output: bool = False,
        float8_dtype: torch.dtype = torch.float8_e4m3fn,
        fwd_config_submodule_fqn: str | None = None,
    ):
        if use_local_output:
            raise ValueError(
                "PrepareFloat8ModuleInput(use_local_output=True): the colwise layers need the "
                "DTensor to reduce their partial grad_inputs; keep use_local_output=False"
            )
        super().__init__(
            input_layouts=input_layouts,
            desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=False,
        )
        self.float8_dtype = float8_dtype
        self.fwd_config_submodule_fqn = fwd_config_submodule_fqn
        self._cast = None  # (strategy, emulate), resolved at _apply

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._cast = _input_cast(module, self.float8_dtype, self.fwd_config_submodule_fqn)
        return super()._apply(module, device_mesh)

    def _prepare_input_arg(self, input, mesh, input_layout, desired_layout):
        # as torch's PrepareModuleInput: a DTensor input comes as its own placements say
        # (input_layouts describes plain tensors), so a Shard(0) DTensor is gathered on dim 0
        layout = input_layout
        if isinstance(input, DTensor) and input_layout is not None and input.ndim > 0:
            layout = input.placements[0] if len(input.placements) == 1 else None
        gathers = (
            isinstance(layout, Shard)
            and isinstance(desired_layout, Replicate)
            and isinstance(input, torch.Tensor)
        )
        if not gathers:
            return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)
        assert isinstance(layout, Shard)  # gathers says so
        seq_dim = layout.dim % input.ndim
        length = None  # a plain local shard: even shards assumed, as DTensor.from_local does
        if isinstance(input, DTensor):
            length = input.shape[seq_dim]
            _check_length(length, seq_dim, mesh)
            input = input.to_local()
        strategy, emulate = self._cast
        return _Float8SPAllGather.apply(
            input, mesh, seq_dim, length, _tp_strategy(strategy, mesh), self.float8_dtype, emulate
        )


def _check_length(length: int, seq_dim: int, mesh: DeviceMesh) -> None:
    """Every rank knows the global length: a rank with an empty shard (fewer tokens than
    TP ranks) would have no amax for the shared scale, so all refuse alike."""
    if length < mesh.size():
        raise ValueError(
            f"PrepareFloat8ModuleInput: the sequence dim ({seq_dim}) has {length} tokens for "
            f"{mesh.size()} tensor-parallel ranks, so some ranks hold none; use sequences of "
            f"at least {mesh.size()} tokens, or PrepareModuleInput (high-precision gather)"
        )


def _input_cast_shared(plan: CastPlan) -> bool:
    return plan.shares_cast(Operand.INPUT, Gemm.OUTPUT, Gemm.GRAD_WEIGHT)


def _tp_strategy(strategy, mesh: DeviceMesh):
    if isinstance(strategy, DynamicScaling):
        return strategy.reduced_over(mesh.get_group())
    return strategy  # static: the same number on every rank


def _input_cast(module: nn.Module, float8_dtype: torch.dtype, fqn: str | None):
    """(strategy, emulate) of the input cast of the Float8Linear(s) this module feeds."""
    if fqn is not None:
        layers = [(fqn, module.get_submodule(fqn))]
    else:
        layers = [(n, m) for n, m in module.named_modules() if isinstance(m, Float8Linear)]
    if not layers or not all(isinstance(m, Float8Linear) for _, m in layers):
        raise ValueError(
            f"PrepareFloat8ModuleInput on a {type(module).__name__} with no Float8Linear "
            f"{'at ' + repr(fqn) if fqn else 'below it'}; convert_to_float8_training before "
            "parallelize_module, or use PrepareModuleInput"
        )
    casts = {}
    for name, layer in layers:
        m = check_tp_config(layer, f" ({name})")
        key = (Operand.INPUT, Gemm.OUTPUT)
        strategy, dtype = m.plan.strategies[key], m.plan.dtypes[key]
        if isinstance(strategy, DynamicScaling):  # the input's own cast, not TP-reduced
            strategy = strategy.reduced_over(None)
        if strategy is None or not _input_cast_shared(m.plan) or dtype != float8_dtype:
            raise ValueError(
                f"PrepareFloat8ModuleInput casts {_ONE} to {float8_dtype}, but {name} "
                f"casts its input as {m.extra_repr()}; float8 all-gather of activations "
                f"needs a {_ONE} input cast shared by both GEMMs in that dtype (the "
                f"{recipes_where(one_scale)} recipe): use PrepareModuleInput for other recipes"
            )
        casts[name] = (strategy, m.config.emulate)
    if len(set(casts.values())) > 1:
        raise ValueError(
            f"the Float8Linears below this {type(module).__name__} cast their inputs "
            f"differently ({casts}); name the consumer with fwd_config_submodule_fqn"
        )
    return next(iter(casts.values()))


__all__ = ["PrepareFloat8ModuleInput"]
