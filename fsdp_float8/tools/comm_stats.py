"""Count the collectives a block of code issues, and the bytes each rank puts into them.

Mental model: ``CollectiveCounter`` is a ``TorchDispatchMode``. While it is active, every
op that reaches the dispatcher on this thread passes through it; it keeps a record for each
collective op and lets everything run unchanged. Counting at the dispatcher, rather than by
wrapping ``torch.distributed`` Python functions, is what makes it see all three routes a
collective can take:

- the ``torch.distributed`` API (``dist.all_reduce``, ``all_gather_into_tensor``, ...) and
  what FSDP2 calls (``dist.all_gather_single`` / ``dist.reduce_scatter_single`` from torch
  2.13, ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in 2.11: the same ops), which
  arrive as ``torch.ops.c10d.*`` (``_allgather_base_``, ``_reduce_scatter_base_``,
  ``allreduce_``, ...);
- functional collectives (``torch.distributed._functional_collectives``, DTensor
  redistribution), which arrive as ``torch.ops._c10d_functional.*`` (and the legacy
  ``c10d_functional`` namespace) and never touch the ``torch.distributed`` Python functions;
- DTensor's ``_dtensor.shard_dim_alltoall``.

One record per collective call: its normalised ``kind``, the ``dtype`` of what this rank
sends (FSDP2 may pack float8 all-gather inputs as ``uint8``; that is what is recorded),
``bytes`` = numel * element_size of this rank's *input*, summed over the tensors of a
coalesced/list op (all-gather: the local shard; reduce-scatter: the full unsharded input;
all-reduce/broadcast: the whole tensor), the reduce op as a lowercase string when the op
has one (``"sum"``, ``"avg"``, ``"max"``...), and the group size and name when they can be
read. Bytes are the payload size, not wire traffic (a ring all-reduce moves about
2 * (n-1)/n of it).

What it can see:
- collectives issued on the thread that entered the context, and on threads that inherit
  its dispatch state: a backward pass captures the caller's thread-local state, the
  dispatch-mode stack included (``at::ThreadLocalState`` in the autograd ``GraphTask``), and
  restores it on the autograd device threads, so backward reduce-scatters are seen even
  when the backward runs off the main thread (as on CUDA; not checked on a GPU here).
  Checked on CPU/gloo with torch 2.13: FSDP2 issues all its all-gathers and reduce-scatters
  from the main thread (forward and backward; CPU has no separate streams or threads for
  them), and all are seen.
- async collectives (``async_op=True``): recorded when issued, not when waited on.

What it cannot see:
- collectives issued from a thread that does not inherit the mode, e.g. a plain
  ``threading.Thread`` started by user code;
- collectives inside a backend (e.g. NCCL's internal traffic) or in C++ code that calls a
  ``ProcessGroup`` directly without going through the dispatcher;
- object collectives' payloads are seen only as the tensors they send
  (``all_gather_object`` shows up as tensor all-gathers of sizes and pickled bytes).
It adds a Python call to every op run while active, so enable it for measurement steps,
not for a whole training run.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveCounter", "CollectiveKind", "CollectiveRecord"]


class CollectiveKind(enum.StrEnum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    ALL_TO_ALL = "all_to_all"
    OTHER = "other"


@dataclass(frozen=True)
class CollectiveRecord:
    kind: CollectiveKind
    op: str  # the dispatcher op, e.g. "c10d._allgather_base_.default"
    dtype: torch.dtype | None  # None when the inputs mix dtypes or there are none
    bytes: int  # numel * element_size of this rank's input(s)
    reduce_op: str | None = None  # "sum", "avg", "max", ... for reducing collectives
    group_size: int | None = None
    group_name: str | None = None


@dataclass(frozen=True)
class _OpSpec:
    kind: CollectiveKind
    input_arg: str | None  # schema name of the argument holding what this rank sends


# The reduce op and the group go by one name per namespace (c10d: `reduce_op`,
# `process_group`; functional: `reduce_op`, `group_name`; legacy functional: `reduceOp`, and
# a group only for its p2p ops), so they are read by name, not listed per op.
_REDUCE_ARGS = ("reduce_op", "reduceOp")
_GROUP_ARGS = ("process_group", "group_name")


_K = CollectiveKind

# One table for every collective op at the dispatcher (torch 2.11 to 2.15), keyed by
# "namespace::name". The argument names are the ops' schema names. An op a torch does not
# register is simply never seen (2.11 lacks the functional p2p ops, for instance);
# tests/unit/test_comm_stats_table.py fails when a torch registers one the table lacks.
_SPECS: dict[str, _OpSpec] = {
    # torch.distributed API / ProcessGroup methods
    "c10d::_allgather_base_": _OpSpec(_K.ALL_GATHER, "input_tensor"),
    "c10d::allgather_": _OpSpec(_K.ALL_GATHER, "input_tensors"),
    "c10d::allgather_coalesced_": _OpSpec(_K.ALL_GATHER, "input_list"),
    "c10d::allgather_into_tensor_coalesced_": _OpSpec(_K.ALL_GATHER, "inputs"),
    "c10d::_reduce_scatter_base_": _OpSpec(_K.REDUCE_SCATTER, "input_tensor"),
    "c10d::reduce_scatter_": _OpSpec(_K.REDUCE_SCATTER, "input_tensors"),
    "c10d::reduce_scatter_tensor_coalesced_": _OpSpec(_K.REDUCE_SCATTER, "inputs"),
    "c10d::allreduce_": _OpSpec(_K.ALL_REDUCE, "tensors"),
    "c10d::allreduce_coalesced_": _OpSpec(_K.ALL_REDUCE, "tensors"),
    "c10d::broadcast_": _OpSpec(_K.BROADCAST, "tensors"),
    "c10d::alltoall_": _OpSpec(_K.ALL_TO_ALL, "input_tensors"),
    "c10d::alltoall_base_": _OpSpec(_K.ALL_TO_ALL, "input"),
    "c10d::reduce_": _OpSpec(_K.OTHER, "tensors"),
    "c10d::gather_": _OpSpec(_K.OTHER, "input_tensors"),
    "c10d::gather_into_tensor_": _OpSpec(_K.OTHER, "input_tensor"),  # 2.14+
    "c10d::scatter_": _OpSpec(_K.OTHER, "input_tensors"),
    "c10d::send": _OpSpec(_K.OTHER, "tensors"),
    "c10d::recv_": _OpSpec(_K.OTHER, None),
    "c10d::recv_any_source_": _OpSpec(_K.OTHER, None),
    "c10d::barrier": _OpSpec(_K.OTHER, None),
    "c10d::monitored_barrier_": _OpSpec(_K.OTHER, None),
    # functional collectives (torch.distributed._functional_collectives, DTensor)
    "_c10d_functional::all_gather_into_tensor": _OpSpec(_K.ALL_GATHER, "input"),
    "_c10d_functional::all_gather_into_tensor_out": _OpSpec(_K.ALL_GATHER, "input"),
    "_c10d_functional::all_gather_into_tensor_coalesced": _OpSpec(_K.ALL_GATHER, "inputs"),
    "_c10d_functional::reduce_scatter_tensor": _OpSpec(_K.REDUCE_SCATTER, "input"),
    "_c10d_functional::reduce_scatter_tensor_out": _OpSpec(_K.REDUCE_SCATTER, "input"),
    "_c10d_functional::reduce_scatter_tensor_coalesced": _OpSpec(_K.REDUCE_SCATTER, "inputs"),
    "_c10d_functional::all_reduce": _OpSpec(_K.ALL_REDUCE, "input"),
    "_c10d_functional::all_reduce_": _OpSpec(_K.ALL_REDUCE, "input"),
    "_c10d_functional::all_reduce_coalesced": _OpSpec(_K.ALL_REDUCE, "inputs"),
    "_c10d_functional::all_reduce_coalesced_": _OpSpec(_K.ALL_REDUCE, "inputs"),
    "_c10d_functional::broadcast": _OpSpec(_K.BROADCAST, "input"),
    "_c10d_functional::broadcast_": _OpSpec(_K.BROADCAST, "input"),
    "_c10d_functional::all_to_all_single": _OpSpec(_K.ALL_TO_ALL, "input"),
    "_c10d_functional::batch_p2p_ops": _OpSpec(_K.OTHER, "tensors"),
    "_c10d_functional::isend": _OpSpec(_K.OTHER, "tensor"),
    "_c10d_functional::irecv": _OpSpec(_K.OTHER, None),
    "_dtensor::shard_dim_alltoall": _OpSpec(_K.ALL_TO_ALL, "input"),
    # legacy functional collectives (tag + ranks instead of a group name)
    "c10d_functional::all_gather_into_tensor": _OpSpec(_K.ALL_GATHER, "shard"),
    "c10d_functional::all_gather_into_tensor_coalesced": _OpSpec(_K.ALL_GATHER, "input"),
    "c10d_functional::reduce_scatter_tensor": _OpSpec(_K.REDUCE_SCATTER, "input"),
    "c10d_functional::reduce_scatter_tensor_coalesced": _OpSpec(_K.REDUCE_SCATTER, "inputs"),
    "c10d_functional::all_reduce": _OpSpec(_K.ALL_REDUCE, "self"),
    "c10d_functional::all_reduce_coalesced": _OpSpec(_K.ALL_REDUCE, "self"),
    "c10d_functional::broadcast": _OpSpec(_K.BROADCAST, "self"),
    "c10d_functional::all_to_all_single": _OpSpec(_K.ALL_TO_ALL, "input"),
    "c10d_functional::batch_p2p_ops": _OpSpec(_K.OTHER, "tensors"),
    "c10d_functional::isend": _OpSpec(_K.OTHER, "self"),
    "c10d_functional::irecv": _OpSpec(_K.OTHER, None),
}

# Ops in the collective namespaces that move no data between ranks.
_NOT_COLLECTIVES = frozenset(
    {
        "_c10d_functional::wait_tensor",
        "_c10d_functional::wait_tensors",  # torch 2.15+
        "_c10d_functional::_wrap_tensor_autograd",
        "c10d_functional::wait_tensor",
        "c10d::check_for_nan",
        "_dtensor::mesh_get_process_group",
    }
)
_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})


class CollectiveCounter(TorchDispatchMode):
    """Record every collective issued while active (see the module docstring).

    >>> with CollectiveCounter() as counter:
    ...     loss = model(x).sum()
    ...     loss.backward()
    >>> counter.count("all_gather"), counter.bytes("reduce_scatter")
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[CollectiveRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in _NAMESPACES:
            record = _make_record(func, args, kwargs)
            if record is not None:
                self.records.append(record)  # list.append is atomic under the GIL
        return func(*args, **kwargs)

    def count(self, kind: CollectiveKind | str | None = None) -> int:
        """Number of collectives of ``kind`` (all kinds when None)."""
        return sum(1 for _ in self._select(kind))

    def bytes(self, kind: CollectiveKind | str | None = None) -> int:
        """Input bytes this rank put into collectives of ``kind`` (all kinds when None)."""
        return sum(r.bytes for r in self._select(kind))

    def summary(self) -> dict[str, dict[str, Any]]:
        """``{kind: {"count": n, "bytes": b, "bytes_by_dtype": {"torch.float32": b, ...}}}``
        for each kind seen, in order of first appearance."""
        out: dict[str, dict[str, Any]] = {}
        for r in self.records:
            entry = out.setdefault(str(r.kind), {"count": 0, "bytes": 0, "bytes_by_dtype": {}})
            entry["count"] += 1
            entry["bytes"] += r.bytes
            by_dtype = entry["bytes_by_dtype"]
            by_dtype[str(r.dtype)] = by_dtype.get(str(r.dtype), 0) + r.bytes
        return out

    def reset(self) -> None:
        self.records.clear()

    def as_dicts(self) -> list[dict[str, Any]]:
        """The records as plain dicts (dtype as a string), e.g. to print or pickle."""
        return [{**asdict(r), "kind": str(r.kind), "dtype": str(r.dtype)} for r in self.records]

    def _select(self, kind: CollectiveKind | str | None) -> Iterable[CollectiveRecord]:
        if kind is None:
            return self.records
        try:
            wanted = CollectiveKind(kind)
        except ValueError:
            known = ", ".join(k.value for k in CollectiveKind)
            raise ValueError(
                f"unknown collective kind {kind!r}; expected one of: {known} (or None for all)"
            ) from None
        return (r for r in self.records if r.kind == wanted)


def _make_record(func: Any, args: tuple, kwargs: dict) -> CollectiveRecord | None:
    name = func._schema.name  # "namespace::op"
    if name in _NOT_COLLECTIVES:
        return None
    spec = _SPECS.get(name)
    bound = _bind(func, args, kwargs)
    if spec is None:
        # A collective op this table does not know yet (a newer torch): still count it.
        spec = _OpSpec(_K.OTHER, None)
        tensors = [t for v in bound.values() for t in _tensors(v)]
    else:
        tensors = _tensors(bound.get(spec.input_arg)) if spec.input_arg else []
    dtypes = {t.dtype for t in tensors}
    return CollectiveRecord(
        kind=spec.kind,
        op=str(func),
        dtype=dtypes.pop() if len(dtypes) == 1 else None,
        bytes=sum(t.numel() * t.element_size() for t in tensors),
        reduce_op=_reduce_op_name(_first(bound, _REDUCE_ARGS)),
        group_size=_group_size(bound),
        group_name=_group_name(_first(bound, _GROUP_ARGS)),
    )


def _first(bound: dict[str, Any], names: tuple[str, ...]) -> Any:
    """The value of the first of `names` the op's schema has, else None."""
    return next((bound[n] for n in names if n in bound), None)


def _bind(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def _tensors(value: Any) -> list[torch.Tensor]:
    """Flatten a Tensor, Tensor[] or Tensor[][] argument."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _reduce_op_name(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):  # functional collectives pass "sum", "avg", ...
        return value.lower()
    try:  # c10d ops pass a ScriptObject wrapping c10d::ReduceOp; .op() is its RedOpType
        return dist.ReduceOp.RedOpType(value.op()).name.lower()
    except Exception:
        return None


def _group_size(bound: dict[str, Any]) -> int | None:
    size = bound.get("group_size")
    if isinstance(size, int):
        return size
    group = _process_group(bound.get("process_group"), bound.get("group_name"))
    return group.size() if group is not None else None


def _group_name(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    group = _process_group(value, None)
    return group.group_name if group is not None else None


def _process_group(script_obj: Any, name: Any) -> dist.ProcessGroup | None:
    try:
        if isinstance(script_obj, torch.ScriptObject):
            return dist.ProcessGroup.unbox(script_obj)
        if isinstance(name, str):
            from torch.distributed.distributed_c10d import _resolve_process_group

            return _resolve_process_group(name)  # type: ignore[arg-type]
    except Exception:
        return None
    return None
