"""One float8 cast of an input that several linears read: `input_cast`.

Attention's wq, wk and wv read the same activation, and so do SwiGLU's w1 and w3. When the
input's float8 cast serves both of its GEMMs (a tensorwise scale: `CastPlan.shared`), each
layer casting it again would compute the same amax, write the same float8 bytes, invert the
same scale and save its own copy for backward. The first layer's cast (and the scale's
inverse) is kept for the others instead:

- keyed by the input tensor itself, weakly, and by the cast (scaling strategy and float8
  dtype): a layer with another cast casts anew;
- checked against the input's version counter: a write into the input (or into any view
  of it) between two readers makes the next one cast anew, never read a stale cast;
- held by the readers' autograd contexts only (the table refers to it weakly): it lives
  exactly as long as a reader's backward needs it, so it adds no memory; where no context
  keeps it (no grad, inference tensors) each reader casts for itself;
- only for a scale from the input's own amax (dynamic scaling; delayed scaling records each
  layer's amax in its own history), only for plain tensors, only outside saved-tensor hooks
  (activation checkpointing drops what a forward saves and replays its ops by position: a
  cast kept from the forward would be read by the recompute instead of being replayed), and
  only in eager mode: under torch.compile the graph shares the cast itself.

Backward shares it too: grad_weight takes the kept cast column-major, copied once for all
readers. That copy lives from the first reader's backward to the last one's, instead of
being made and freed by each.
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
class InputCast:
    pair: Pair  # (float8 data, scale)
    inverse: torch.Tensor | None = None  # 1 / scale, once a GEMM has made it
    columns: torch.Tensor | None = None  # the data column-major, once backward made it
    version: int = -1  # the input's version at the cast; -1: not kept
    cast: tuple = ()  # (scaling strategy, float8 dtype)


# input tensor -> weakref(InputCast): the readers' contexts hold it, not the table
_KEPT: WeakIdKeyDictionary = WeakIdKeyDictionary()


def input_cast(x: torch.Tensor, plan: CastPlan, cast: Callable[[], Pair]) -> InputCast:
    """The output GEMM's float8 input for the layer input `x`: kept from an earlier reader
    of `x` with the same cast, else made by `cast()` (and kept where the module docstring
    says)."""
    strategy = plan.strategies[(Operand.INPUT, Gemm.OUTPUT)]
    if (
        strategy is None
        or not strategy.own_amax
        or not plan.shared(Operand.INPUT)
        or torch.compiler.is_compiling()
        or type(x) is not torch.Tensor
        or x.is_inference()
        or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    ):
        return InputCast(cast())
    key = (strategy, plan.dtypes[(Operand.INPUT, Gemm.OUTPUT)])
    ref = _KEPT.get(x)
    kept = None if ref is None else ref()
    if kept is not None and kept.version == x._version and kept.cast == key:
        return kept
    kept = InputCast(cast(), version=x._version, cast=key)
    _KEPT[x] = weakref.ref(kept)
    return kept
