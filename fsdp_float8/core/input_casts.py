"""The float8 casts of an input that several layers read: `shared_casts`.

Off unless the layers' config opts in (`Float8LinearConfig.share_input_casts`, whose
docstring states the contract: no write into the input between readers that leaves its
version counter alone).

Attention's wq, wk and wv read the same activation, and so do SwiGLU's w1 and w3 (linears,
or the grouped experts' projections of the same routed tokens). Cast by each layer alone,
the activation would be cast for the output GEMM once per layer (same amax, same float8
bytes, same inverse scale, one saved copy per layer under tensorwise scaling) and again for
grad_weight once per layer in backward. The readers share one `InputCasts` record instead,
which the first reader of each GEMM fills:

- `forward`: the output GEMM's cast, where it is also saved for grad_weight (tensorwise:
  `CastPlan.shared`); with its `inverse`. Where grad_weight takes another cast (rowwise),
  the forward cast is not saved and is not shared either: keeping it would cost memory.
- `grad_weight`: grad_weight's operand, column-major (the kept forward cast laid out anew,
  or the cast from the saved high-precision input), made by the first reader's backward.

The record is keyed by the input tensor itself, weakly, by the casts (scaling strategy and
float8 dtype of both) and by the layer family's context (the experts' token offsets, by
identity): a layer with other casts or other groups gets a record of its own. It holds the
input's version counter at the first cast: a write into the input (or any view of it)
between two readers gives the next one a new record, never a stale cast. The readers'
autograd contexts hold it, the table only refers to it, and each reader's backward lets go
of it: it lives until the last reader's backward, and adds no memory beyond the one shared
copy. Where no context keeps it (no grad, inference tensors) each reader casts for itself.

Only for scales from the input's own amax (dynamic scaling; delayed scaling records each
layer's amax in its own history), only for plain tensors, only outside saved-tensor hooks
(activation checkpointing drops what a forward saves and replays its ops by position: a
cast kept from the forward would be read by the recompute instead of being replayed), and
only in eager mode: under torch.compile the graph shares the casts itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from fsdp_float8.core.cast_plan import CastPlan, Pair
from fsdp_float8.core.gemms import Gemm, Operand


@dataclass(eq=False)
class InputCasts:
    version: int  # the input's version counter at the first cast
    casts: tuple  # (strategy, float8 dtype) of the output GEMM's and grad_weight's casts
    forward: Pair | None = None  # the output GEMM's (data, scale), when saved for backward
    inverse: torch.Tensor | None = None  # 1 / forward's scale, once a GEMM has made it
    grad_weight: Pair | None = None  # grad_weight's operand, column-major
    context: object = None  # the experts' token offsets; None for a linear


# input tensor -> weakref(InputCasts): the readers' contexts hold the record, not the table
_RECORDS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_CASTS = ((Operand.INPUT, Gemm.OUTPUT), (Operand.INPUT, Gemm.GRAD_WEIGHT))
# torch's own query of the saved-tensor hooks stack (2.11 to 2.15); a torch without it
# shares nothing
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _saved_tensors_hooks_on() -> bool:
    return _TOP_HOOKS is None or _TOP_HOOKS(False) is not None


def shared_casts(x: torch.Tensor, plan: CastPlan, context: object = None) -> InputCasts | None:
    """The record the readers of `x` with `plan`'s input casts (and `context`) share
    (module docstring); None where nothing is shared."""
    if not plan.share_input_casts:
        return None
    strategies = [plan.strategies[k] for k in _CASTS]
    if (
        any(s is None or not s.own_amax for s in strategies)
        or torch.compiler.is_compiling()
        or type(x) is not torch.Tensor
        or x.is_inference()
        or _saved_tensors_hooks_on()
    ):
        return None
    casts = tuple((s, plan.dtypes[k]) for s, k in zip(strategies, _CASTS, strict=True))
    ref = _RECORDS.get(x)
    record = None if ref is None else ref()
    if (
        record is None
        or record.version != x._version
        or record.casts != casts
        or record.context is not context
    ):
        record = InputCasts(x._version, casts, context=context)
        _RECORDS[x] = weakref.ref(record)
    return record


def shared_grad_weight(record: InputCasts | None, make: Callable[[], Pair]) -> Pair:
    """grad_weight's operand of the input: another reader's when `record` has it, else
    `make()` (kept in `record` for the readers after)."""
    if record is None:
        return make()
    if record.grad_weight is None:
        record.grad_weight = make()
    return record.grad_weight
