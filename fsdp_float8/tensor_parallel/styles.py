"""Float8 tensor parallelism (TP, with sequence parallelism): styles for `parallelize_module`.

Mental model. Under TP a `Float8Linear` runs the very same autograd function as on one
process, on the rank's *local* tensors. The styles around it own the collectives:
- `Float8ColwiseParallel`: weight `Shard(0)` (output features split). The input arrives
  whole (high-precision DTensor redistribution, or already float8 from
  `PrepareFloat8ModuleInput`), the output leaves sharded on its last dim, grad_input is a
  partial sum that the input's redistribution reduces (reduce-scatter under sequence
  parallelism, all-reduce otherwise).
- `Float8RowwiseParallel`: weight `Shard(1)` (input features split). The input arrives
  sharded on its last dim, the output is a partial sum reduced by the output's
  redistribution (`output_layouts`: `Shard(1)` reduce-scatters, `Replicate()` all-reduces).
- `PrepareFloat8ModuleInput` (in `tensor_parallel_input`): on the module that feeds colwise layers (attention, MLP), casts
  the sequence-parallel activation to float8 *before* its all-gather (1 byte per element;
  the tensorwise scale comes from an amax all-reduced over the TP group, so it needs no
  bytes of its own) and hands the consumers a `DTensor(Float8Tensor, Replicate)`; its
  backward reduce-scatters the high-precision gradient.

Scales equal a single process's. In the local 2-D forms input (M, K), weight (N, K) and
grad_output (M, N), colwise shards N (weight dim 0, grad_output dim 1) and rowwise shards K
(weight dim 1, input dim 1). A scale covers what its amax reduces over: the whole tensor
(tensorwise) or the GEMM's contraction dim (rowwise). It needs an all-reduce MAX over the TP
group exactly when that reduction spans the operand's sharded dim, and nowhere else:

| layer   | input                | weight                       | grad_output              |
|---------|----------------------|------------------------------|--------------------------|
| colwise | whole: none          | tensorwise; rowwise for the  | tensorwise; rowwise for  |
|         |                      | grad_input GEMM (1, K)       | grad_input (M, 1)        |
| rowwise | tensorwise; rowwise  | tensorwise; rowwise for the  | whole: none              |
|         | for the output (M,1) | output GEMM (N, 1)           |                          |

So every rank casts the bits a single process would, and the only difference from one
process is the order in which partial sums of a split contraction are added. The style
gives the layer a `TensorParallelLayout` and a cast plan whose strategies reduce where the
table says (`DynamicScaling.reduced_over` the TP group: the one scale path). Under FSDP2 on a (dp, tp) mesh the
weight scales come from the float8 all-gather's pre-hook, whose amax group is the sharded
parameter's mesh dims (`amax_sync.shard_group`).

Why local tensors and explicit collectives, not DTensor sharding rules for Float8Tensor
(torchao's design, where the GEMMs and casts dispatch through DTensor): `linear.py` works on
(data, scale) pairs of plain tensors so one autograd function serves every path; a
tensorwise amax of a sharded DTensor is an implicit Partial(max) reduction that nobody sees
or counts (here `amax_sync` stays the only caller of a MAX all-reduce); rowwise scales would
need sharding rules of their own, tied to DTensor's private propagation of `_scaled_mm` on a
range of torch versions (2.11 to 2.15); and with explicit reductions the single-process
numerics hold by construction, operand by operand. DTensor
stays the outermost wrapper wherever a tensor crosses a module boundary: parameters (so
FSDP2 and DCP see TP shards) and the float8 activation.

Supported: dynamic and static scaling, tensorwise and rowwise (axiswise) granularity.
Refused with a remedy: delayed scaling (its first casts use each rank's own amax) and any
other granularity (block scales).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
)

from fsdp_float8.core.cast_plan import CastPlan, block_cast
from fsdp_float8.core.families import (
    DEFAULT_RECIPE,
    broadcasting,
    families_where,
    one_scale,
    recipes_where,
)
from fsdp_float8.core.float8_tensor import Float8Tensor
from fsdp_float8.core.gemms import CONTRACTION_DIM, Gemm, Operand
from fsdp_float8.core.scaling import (
    DelayedScaling,
    DynamicScaling,
    StaticScaling,
)
from fsdp_float8.nn.linear import Float8Linear
from fsdp_float8.weight_wrappers.base import plain_weight

COLWISE, ROWWISE = "colwise", "rowwise"
# the sharded dim of each operand's local 2-D form (see the module docstring)
_SHARDED_DIM = {
    COLWISE: {Operand.WEIGHT: 0, Operand.GRAD_OUTPUT: 1},
    ROWWISE: {Operand.WEIGHT: 1, Operand.INPUT: 1},
}


@dataclass(frozen=True)
class TensorParallelLayout:
    """How a style split a Float8Linear: `style` colwise or rowwise over `mesh` (1-D)."""

    style: str
    mesh: DeviceMesh

    def sharded_dim(self, operand: Operand) -> int | None:
        return _SHARDED_DIM[self.style].get(operand)

    def reduces(self, operand: Operand, gemm: Gemm, strategy) -> bool:
        """True when this cast's amax spans the operand's TP-sharded dim."""
        dim = self.sharded_dim(operand)
        if dim is None or isinstance(strategy, StaticScaling):
            return False
        if one_scale(strategy.granularity.family):
            return True
        return CONTRACTION_DIM[(gemm, operand)] % 2 == dim


def tp_cast_plan(plan: CastPlan, layout: TensorParallelLayout) -> CastPlan:
    """`plan` with every cast whose amax spans a TP-sharded dim reduced over the TP group."""
    group = layout.mesh.get_group()
    strategies = {}
    for (operand, gemm), strategy in plan.strategies.items():
        if isinstance(strategy, DynamicScaling) and layout.reduces(operand, gemm, strategy):
            strategy = strategy.reduced_over(group)
        strategies[(operand, gemm)] = strategy
    return replace(plan, strategies=strategies)


def check_tp_config(module: nn.Module, fqn_hint: str = "") -> Float8Linear:
    """The module as a Float8Linear that tensor parallelism can run with single-process
    scales; anything else is refused with a remedy."""
    if not isinstance(module, Float8Linear):
        raise TypeError(
            f"fsdp_float8's float8 TP styles apply to Float8Linear layers, got "
            f"{type(module).__name__}{fqn_hint}; run convert_to_float8_training first (then "
            "parallelize_module), or use torch's ColwiseParallel/RowwiseParallel for "
            "high-precision layers"
        )
    if any(isinstance(s, DelayedScaling) for s in module.plan.strategies.values()):
        raise ValueError(
            f"delayed scaling under tensor parallelism is not supported{fqn_hint}: before the "
            "first sync each TP rank would scale its shard by its own amax, not the tensor's. "
            f"Use dynamic scaling (e.g. Float8LinearConfig.from_recipe_name({DEFAULT_RECIPE!r})) or "
            "static scaling for tensor-parallel layers"
        )
    blocked = block_cast(module.plan.strategies)
    if blocked is not None:
        raise ValueError(
            f"float8 tensor parallelism supports {families_where(broadcasting, 'and')} "
            f"scales, got {type(blocked[2]).__name__}{fqn_hint}; use the "
            f"{recipes_where(broadcasting)} recipe for tensor-parallel layers, or keep this "
            "layer out of the TP plan"
        )
    return module


def _prepare(layer: nn.Module, mesh: DeviceMesh, style: str, weight_dim: int, src: int | None):
    """Shard the weight (bias colwise: with it), keep the float8 wrapper, set the layout."""
    if mesh.ndim != 1:
        raise ValueError(
            f"float8 TP styles take a 1-D TP mesh, got {mesh.ndim}-D {mesh}; pass mesh['tp']"
        )
    module = check_tp_config(layer)
    if style == ROWWISE and module.bias is not None:
        raise ValueError(
            "Float8RowwiseParallel of a Float8Linear with a bias: each TP rank would add the "
            "bias to its partial sum. Build the layer with bias=False (add a bias after the "
            "layer), or keep it out of the TP plan"
        )
    weight = plain_weight(module.weight)
    if isinstance(weight, DTensor):
        raise ValueError(
            f"this Float8Linear's weight is already a DTensor {weight.placements}; apply the "
            "TP plan once, before fully_shard"
        )
    module.weight = nn.Parameter(
        distribute_tensor(weight.data, mesh, [Shard(weight_dim)], src_data_rank=src),
        requires_grad=module.weight.requires_grad,
    )
    if module.bias is not None:
        module.bias = nn.Parameter(
            distribute_tensor(module.bias.data, mesh, [Shard(0)], src_data_rank=src),
            requires_grad=module.bias.requires_grad,
        )
    module.wrap_weight_for_fsdp()  # the local shard becomes the float8 all-gather wrapper
    layout = TensorParallelLayout(style, mesh)
    module.tensor_parallel = layout
    module.plan = tp_cast_plan(module.plan, layout)


class Float8ColwiseParallel(ColwiseParallel):
    """torch's ColwiseParallel for a Float8Linear (same arguments): weight `Shard(0)`, local
    float8 GEMMs; the input may arrive already float8 (`PrepareFloat8ModuleInput`)."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = inputs[0]
        if isinstance(x, DTensor) and isinstance(x._local_tensor, Float8Tensor):
            _check_precast(mod, x)
        else:
            x = ColwiseParallel._prepare_input_fn(
                input_layouts, desired_input_layouts, mod, inputs, device_mesh
            )
        # the local grad_input is this rank's partial sum: the input's redistribution
        # reduces it (reduce-scatter to the sequence shards, or all-reduce)
        return x.to_local(grad_placements=(Partial(),))

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        out = DTensor.from_local(outputs, device_mesh, (Shard(-1),), run_check=False)
        return ColwiseParallel._prepare_output_fn(
            output_layouts, use_local_output, mod, out, device_mesh
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _prepare(module, device_mesh, COLWISE, 0, self.src_data_rank)
        return _distribute(self, module, device_mesh)


class Float8RowwiseParallel(RowwiseParallel):
    """torch's RowwiseParallel for a Float8Linear (same arguments): weight `Shard(1)`, local
    float8 GEMMs, the partial output reduced to `output_layouts`."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = RowwiseParallel._prepare_input_fn(
            input_layouts, desired_input_layouts, mod, inputs, device_mesh
        )
        return x.to_local()  # grad_input is this rank's shard, complete

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        out = DTensor.from_local(outputs, device_mesh, (Partial(),), run_check=False)
        return RowwiseParallel._prepare_output_fn(
            output_layouts, use_local_output, mod, out, device_mesh
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _prepare(module, device_mesh, ROWWISE, 1, self.src_data_rank)
        self.desired_input_layouts = (Shard(-1),)
        return _distribute(self, module, device_mesh)


def _distribute(style, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    def input_fn(mod, inputs, device_mesh):
        return style._prepare_input_fn(
            style.input_layouts, style.desired_input_layouts, mod, inputs, device_mesh
        )

    def output_fn(mod, outputs, device_mesh):
        return style._prepare_output_fn(
            style.output_layouts, style.use_local_output, mod, outputs, device_mesh
        )

    return distribute_module(module, mesh, None, input_fn, output_fn)


def _check_precast(mod: Float8Linear, x: DTensor) -> None:
    if x.placements != (Replicate(),):
        raise ValueError(
            f"a float8 input of a colwise layer must be Replicate, got {x.placements}; "
            "PrepareFloat8ModuleInput(desired_input_layouts=Replicate()) gathers it"
        )
    want = mod.plan.dtypes[(Operand.INPUT, Gemm.OUTPUT)]
    local = x._local_tensor
    assert isinstance(local, Float8Tensor)  # the caller checked
    got = local.float8_dtype
    if got != want or not mod.plan.shares_cast(Operand.INPUT, Gemm.OUTPUT, Gemm.GRAD_WEIGHT):
        raise TypeError(
            f"this colwise Float8Linear casts its input as {mod.extra_repr()}, but got a "
            f"{got} one-scale float8 input from PrepareFloat8ModuleInput; give that style "
            "the layer's float8_dtype, or use PrepareModuleInput (high-precision gather)"
        )


# the module-input style lives beside, in tensor_parallel_input (it builds on these)
__all__ = [
    "Float8ColwiseParallel",
    "Float8RowwiseParallel",
    "TensorParallelLayout",
]
