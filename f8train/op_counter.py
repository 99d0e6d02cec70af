"""Counting what a step runs: ops by name and the bytes they write, from a dispatch mode.

`OpCounter` is a `TorchDispatchMode` that counts every non-view aten and fsdp_float8 op two
ways: `top`, as the mode sees it from outside, and `deep`, where a float8 tensor subclass
or the CPU GEMM op is opened and the ops it runs inside are counted instead. Alongside it
sums, per op name, the bytes each op writes (`written_bytes`) outside the GEMMs and the
collectives. The counts need no clock, so they compare recipes on any machine, a CPU
included.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_float8.core.gemm import _cpu_scaled_mm

_COUNTED = ("aten", "fsdp_float8")  # so collectives (c10d, _c10d_functional) never count
_OPENED_OPS = {torch.ops.fsdp_float8.cpu_scaled_mm.default: _cpu_scaled_mm}
# Matrix products by op name (the mode sees `linear` and `matmul` as the mm/addmm/bmm they
# decompose to): their outputs are the GEMM's own writes, not the work around it.
GEMM_OPS = frozenset(
    "mm addmm bmm baddbmm addbmm mv addmv dot matmul linear _int_mm _scaled_mm _scaled_mm_v2"
    " scaled_mm _grouped_mm _scaled_grouped_mm _scaled_grouped_mm_v2 cpu_scaled_mm".split()
)
_NO_WRITE = frozenset(  # they allocate or resize and write no data
    "empty empty_like empty_strided new_empty new_empty_strided resize_ set_".split()
)


class OpCounter(TorchDispatchMode):
    """Non-view ops (aten's, fsdp_float8's) by name: `top` as a dispatch mode sees them;
    `deep` opens the float8 subclasses (fsdp_float8's, torchao's; not DTensor) and the CPU
    GEMM op and counts what they run inside instead. `kinds`: every top op, views too, by
    `kind(name, args, kwargs)` when given. Host reads are `top["_local_scalar_dense"]`.
    `written`: bytes written by the `deep` ops and FSDP2's copy ops that are no GEMM
    (`GEMM_OPS`, and all that runs inside the CPU GEMM op, as it runs inside a CUDA GEMM)
    and no collective, by name (`written_bytes`)."""

    def __init__(self, kind: Callable[[str, tuple, dict], str] | None = None) -> None:
        super().__init__()
        self.top, self.deep, self.kinds = Counter(), Counter(), Counter()
        self.written: Counter = Counter()
        self._kind, self._depth, self._in_gemm = kind, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs, name = kwargs or {}, func.overloadpacket.__name__
        if self._kind is not None and self._depth == 0:
            self.kinds[self._kind(name, args, kwargs)] += 1
        sub = next((t for t in types if t.__module__.startswith(("fsdp_float8", "torchao"))), None)
        inner = _OPENED_OPS.get(func)
        gemm = int(inner is not None)
        if inner is None and sub is not None:
            inner = lambda *a, **k: sub.__torch_dispatch__(func, types, a, k)
        if inner is None:
            out = func(*args, **kwargs)
        else:  # open it: what it runs inside is counted in `deep`
            self._depth, self._in_gemm = self._depth + 1, self._in_gemm + gemm
            try:
                with self:
                    out = inner(*args, **kwargs)
            finally:
                self._depth, self._in_gemm = self._depth - 1, self._in_gemm - gemm
        if func.namespace in _COUNTED and not _is_view(func, args, out):
            if self._depth == 0:
                self.top[name] += 1
            if inner is None:
                self.deep[name] += 1
        writes = func.namespace in (*_COUNTED, "fsdp") and inner is None and not self._in_gemm
        if writes and name not in GEMM_OPS and name not in _NO_WRITE:
            if n := written_bytes(func, args, kwargs, out):
                self.written[name] += n
        return out


def written_bytes(func, args: tuple, kwargs: dict, out) -> int:
    """Bytes (numel * element_size) an op writes: each argument it mutates (in place,
    `out=`), whole; and each returned tensor with storage of its own. A return that shares
    storage with an input (a view, the `self` an in-place op returns, a `contiguous` that
    copied nothing) is no new write. A DTensor counts its local shard (bytes per rank).
    FSDP2's copy ops (namespace `fsdp`) count too: `chunk_cat` and `split_with_sizes_copy`
    by their `out`; `all_gather_copy_in` writes its shards into the all-gather buffer that
    it returns (the gather itself, a collective, fills the rest)."""
    if func.namespace == "fsdp" and func.overloadpacket.__name__ == "all_gather_copy_in":
        return _nbytes(args[0])
    schema, total = func._schema, 0
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            total += _nbytes(args[i] if i < len(args) else kwargs.get(arg.name))
    inputs = {_storage(t) for t in _plain_tensors([args, kwargs])}
    outs = out if len(schema.returns) > 1 else (out,)
    for ret, value in zip(schema.returns, outs):
        if ret.alias_info is None:
            fresh = [t for t in _plain_tensors(value) if _storage(t) not in inputs]
            total += sum(t.numel() * t.element_size() for t in fresh)
    return total


def _plain_tensors(value) -> list[torch.Tensor]:
    """The plain tensors in a (nested) value: a DTensor's local shard, a wrapper subclass's
    inner tensors."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _plain_tensors(v)]
    if isinstance(value, dict):
        return _plain_tensors(list(value.values()))
    if isinstance(value, DTensor):
        return _plain_tensors(value._local_tensor)
    if is_traceable_wrapper_subclass(value):
        names, _ = value.__tensor_flatten__()
        return _plain_tensors([getattr(value, n) for n in names])
    return [value] if isinstance(value, torch.Tensor) else []


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in _plain_tensors(value))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _is_view(func, args, out) -> bool:
    """A view does no work: `_unsafe_view` (a view whose schema declares no alias) and the
    ops whose schema may alias (`contiguous`, `reshape`) unless their output has its own
    storage (a wrapper subclass has no storage: a view)."""
    if func is torch.ops.aten._unsafe_view.default:
        return True
    if not func.is_view:
        return False
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor) or not isinstance(out, torch.Tensor):
        return True
    try:
        return out.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return True
