"""What an optimizer holds, seen by the float8 step's optimizer hooks: a step counted as a
write into each float8-gathered weight before it runs, and Parameters that conversion
replaced (an optimizer built before conversion) refused."""

from __future__ import annotations

import weakref

from torch.distributed.tensor import DTensor

from fsdp_float8.weight_wrappers.base import Float8WeightWrapper
from fsdp_float8.weight_wrappers.wrap import replaced_parameter


def count_step_as_write(optimizer) -> None:
    """Count the step about to run as a write into every float8-gathered weight the
    optimizer holds, before it runs. A step whose kernels write the weights' storage below
    the wrappers' dispatch (a compiled `optimizer.step`, another library's fused or low-bit
    kernel) moves neither their mutation generation nor their inner tensors' versions:
    without this, the scales and packs made before the step would look fresh and the next
    forward would use the old values. Scales stamped after the step (the automatic refresh,
    or a precompute in the optimizer's own post hook) are from the new values and stay."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            local = p._local_tensor if isinstance(p, DTensor) else p
            if isinstance(local, Float8WeightWrapper):
                local._state.bump()


_checked_optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def refuse_replaced_parameters(optimizer) -> None:
    """An optimizer built before conversion holds Parameters that conversion replaced:
    they are no longer in the model and would train nothing. Checked once per optimizer
    (again after `add_param_group`)."""
    n = sum([len(g["params"]) for g in optimizer.param_groups])
    if _checked_optimizers.get(optimizer) == n:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            where = replaced_parameter(p)
            if where is not None:
                raise ValueError(
                    f"this {type(optimizer).__name__} holds the Parameter {where} that "
                    "convert_to_float8_training replaced (float8 all-gather wraps each weight "
                    "in a new Parameter): the optimizer would update a tensor the model no "
                    "longer uses, so that layer would never train. Convert the model before "
                    "building the optimizer (or rebuild the optimizer from model.parameters())"
                )
    _checked_optimizers[optimizer] = n
