"""Do all ranks run the same float8 model, and are they all here? A handshake through the store.

A refresh collective that one rank starts alone (a rank that never converted its model, an
explicit precompute or an in-place load on one rank only) would meet another collective of
another size on the other ranks: gloo aborts a rank, NCCL hangs. So every refresh that is
not the steady one after `optimizer.step()` (the first of a group, one before a forward,
an explicit call) is preceded by `handshake`: each rank checks in through the process
group's store (O(1) store operations per rank, no collective) and waits until all have, at
most the store's timeout (`FSDP_FLOAT8_RANK_WAIT_S` overrides it); ranks that never come
are named in a RuntimeError on the ranks that did. The first handshake of a group also
carries the config fingerprint: `fingerprint(weights)` hashes each setting over every
linear and expert weight into one float64 per field, and ranks that converted differently
(another recipe, scaling type, static scale, float8 all-gather on one rank only, another
module filter) get a ValueError on every rank naming each field and the ranks holding each
value. The fake backend (one process playing one rank) has no usable store and is not
checked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_float8.core.config import Float8LinearConfig

FIELDS: tuple[str, ...] = (
    "float8_layers",
    *(f.name for f in dataclasses.fields(Float8LinearConfig)),
    "weight_wrapper",
)


def _hash(text: str) -> float:
    # process-independent (Python's hash() of a str is salted per process)
    return float(int(hashlib.sha256(text.encode()).hexdigest()[:13], 16))


def _field_value(module: nn.Module, name: str, field: str) -> object:
    config = getattr(module, "config", None)
    if field == "float8_layers":
        return config is not None
    if config is None:
        return None
    if field == "weight_wrapper":
        w = getattr(module, name)
        return type(w._local_tensor if isinstance(w, DTensor) else w).__name__
    return getattr(config, field)


def fingerprint(weights: list[tuple[str, nn.Module, str]]) -> torch.Tensor:
    """One float64 per `FIELDS` entry: a hash of that setting over every (fqn, module,
    weight name): the weights of linear layers and of float8 experts."""
    return torch.tensor(
        [_hash(repr([(fqn, _field_value(m, n, f)) for fqn, m, n in weights])) for f in FIELDS],
        dtype=torch.float64,
    )


def check_agreement(fingerprints: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """`fingerprints` is (ranks, len(FIELDS)), gathered from every rank of `group`."""
    rows = fingerprints.tolist()
    if all(row == rows[0] for row in rows):
        return
    ranks = [dist.get_global_rank(group, i) if group else i for i in range(len(rows))]
    diffs = []
    for j, name in enumerate(FIELDS):
        holders: dict[float, list[int]] = {}
        for rank, row in zip(ranks, rows, strict=True):
            holders.setdefault(row[j], []).append(rank)
        if len(holders) > 1:
            diffs.append(f"{name}: ranks " + " vs ".join(str(r) for r in holders.values()))
    raise ValueError(
        "float8 settings differ across the ranks of the mesh ("
        + "; ".join(diffs)
        + "): every rank must convert the same model with the same Float8LinearConfig and "
        "module_filter_fn (check rank-dependent flags, environment variables and config files)"
    )


_SEQ: dict[str, int] = {}  # group key -> handshakes done on this rank


def _store_of(pg: dist.ProcessGroup) -> dist.Store | None:
    """The group's key-value store (None: the fake backend, or no store torch exposes)."""
    if dist.get_backend(pg) == "fake":
        return None
    world = getattr(dist.distributed_c10d, "_world", None)
    entry = getattr(world, "pg_map", {}).get(pg)
    return entry[1] if entry else None


def _wait_s(store: dist.Store) -> float:
    text = os.environ.get("FSDP_FLOAT8_RANK_WAIT_S")
    if text is None:  # the store's timeout is the process group's (init_process_group)
        return getattr(store, "timeout", dist.default_pg_timeout).total_seconds()
    try:
        return float(text)
    except ValueError:
        raise ValueError(
            f"FSDP_FLOAT8_RANK_WAIT_S={text!r} is not a number of seconds: unset it (the "
            "process group's timeout applies) or give e.g. 600"
        ) from None


def handshake(pg: dist.ProcessGroup, head: torch.Tensor | None, what: str) -> None:
    """Wait until every rank of `pg` reached the same refresh (`what` names it in errors);
    with `head` (this rank's `fingerprint`), also check that the ranks agree. Nothing to
    check without a usable store (the fake backend)."""
    store = _store_of(pg)
    if store is None:
        return
    ranks = dist.get_process_group_ranks(pg)
    me = dist.get_rank()
    key = hashlib.sha256(repr(ranks).encode()).hexdigest()[:16]
    seq = _SEQ[key] = _SEQ.get(key, 0) + 1
    prefix = f"fsdp_float8/handshake/{key}"
    mine = "" if head is None else repr(head.tolist())
    store.set(f"{prefix}/{seq}/{me}", mine)
    timeout = timedelta(seconds=_wait_s(store))
    try:
        store.wait([f"{prefix}/{seq}/{ranks[0]}"], timeout)
        if store.get(f"{prefix}/{seq}/{ranks[0]}").decode() != mine:
            store.add(f"{prefix}/{seq}/differ", 1)
        if store.add(f"{prefix}/{seq}/arrived", 1) == len(ranks):
            store.set(f"{prefix}/{seq}/all", "1")
        store.wait([f"{prefix}/{seq}/all"], timeout)
    except RuntimeError as e:  # the store's wait timed out
        missing = [r for r in ranks if not store.check([f"{prefix}/{seq}/{r}"])]
        raise RuntimeError(
            f"rank {me} waited {timeout.total_seconds():g} s at the float8 {what} for ranks "
            f"{missing} of {ranks}, which never reached it ({e}). Every rank must convert "
            "the model alike (convert_to_float8_training before fully_shard) and run the "
            "same float8 calls: an explicit precompute / sync, a checkpoint load or an "
            "in-place write into weights on some ranks only starts a collective the others "
            "never join. FSDP_FLOAT8_RANK_WAIT_S sets how long a rank waits"
        ) from None
    if seq > 2:  # every rank is past handshake seq - 2: its keys are read
        old = f"{prefix}/{seq - 2}"
        store.delete_key(f"{old}/{me}")
        if me == ranks[0]:
            for name in ("differ", "arrived", "all"):
                store.delete_key(f"{old}/{name}")
    if head is not None and int(store.add(f"{prefix}/{seq}/differ", 0)):
        rows = [_row(store.get(f"{prefix}/{seq}/{r}").decode()) for r in ranks]
        check_agreement(torch.tensor(rows, dtype=torch.float64), pg)


def _row(text: str) -> list[float]:
    """A fingerprint row as `handshake` stores it (the repr of a list of floats); -1 in
    every field for a rank that sent none (it had checked this group already)."""
    return [float(v) for v in text.strip("[]").split(",")] if text else [-1.0] * len(FIELDS)
