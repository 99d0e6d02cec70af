"""Do all ranks run the same float8 model, and are they all here? A handshake through the store.

A refresh collective that one rank starts alone (a rank that never converted its model, an
optimizer step, an explicit precompute or an in-place load on one rank only) would meet
another collective of another size on the other ranks: gloo aborts a rank, NCCL hangs. So
every refresh that issues a collective is preceded by `handshake`: each rank checks in
through the process group's store (O(1) store operations per rank, no collective) and waits
until all have, at most the store's timeout (`FSDP_FLOAT8_RANK_WAIT_S`, a finite number of
seconds > 0, overrides it); a rank still waiting after `NOTICE_S` says once on stderr what
for, and ranks that never come are named in a RuntimeError on the ranks that did. The
handshakes are counted per process group and rank, so ranks that share a process (torch's
multi-threaded test process group) meet at the same keys. The first handshake of a group also
carries the config fingerprint: `fingerprint(weights)` hashes each setting over every
linear and expert weight into one float64 per field, and ranks that converted differently
(another recipe, scaling type, static scale, float8 all-gather on one rank only, another
module filter, weights of another shape or dtype) get a ValueError on every rank naming each
field and the ranks holding each value; so do ranks of which some hold float8 layers that were
converted or replaced since their group's first check and others do not. The fake backend
(one process playing one rank) has no usable store and is not checked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_float8.core.config import Float8LinearConfig

FIELDS: tuple[str, ...] = (
    "float8_layers",
    "weight_shape",  # the global shape (FSDP2's all-gathers are sized by it)
    "weight_dtype",
    *(f.name for f in dataclasses.fields(Float8LinearConfig)),
    "weight_wrapper",
    "layer_config",  # a config of another type (a format's own, with a linear_class): its repr
)


def _hash(text: str) -> float:
    # process-independent (Python's hash() of a str is salted per process)
    return float(int(hashlib.sha256(text.encode()).hexdigest()[:13], 16))


# told when a layer is float8 on some ranks only; the config fields follow from it
_LAYER_FIELDS = ("float8_layers:", "weight_shape:", "weight_dtype:")


def _field_value(module: nn.Module, name: str, field: str) -> object:
    config = getattr(module, "config", None)
    if field == "float8_layers":
        return config is not None
    if field in ("weight_shape", "weight_dtype"):
        w = getattr(module, name)
        return tuple(w.shape) if field == "weight_shape" else str(w.dtype)
    if config is None:
        return None
    if field == "weight_wrapper":
        w = getattr(module, name)
        return type(w._local_tensor if isinstance(w, DTensor) else w).__name__
    if not isinstance(config, Float8LinearConfig):
        return repr(config) if field == "layer_config" else None
    return None if field == "layer_config" else getattr(config, field)


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
    # a rank that sent no fingerprint had checked all its float8 layers at an earlier refresh
    before = [r for r, row in zip(ranks, rows, strict=True) if row == _row("")]
    diffs = []
    for j, name in enumerate(FIELDS):
        holders: dict[float, list[int]] = {}
        for rank, row in zip(ranks, rows, strict=True):
            holders.setdefault(row[j], []).append(rank)
        if len(holders) > 1:
            diffs.append(f"{name}: ranks " + " vs ".join(str(r) for r in holders.values()))
    if diffs and diffs[0].startswith("float8_layers:"):  # a layer float8 on some ranks only:
        # its config fields differ with it (None on the others), so they are not listed
        diffs = [d for d in diffs if d.startswith(_LAYER_FIELDS)]
    if before:  # their rows are -1 in every field: only `float8_layers` is told
        diffs = diffs[:1] + [
            f"ranks {before} had checked their float8 layers before, the others hold float8 "
            "layers converted or replaced since"
        ]
    raise ValueError(
        "float8 settings differ across the ranks of the mesh ("
        + "; ".join(diffs)
        + "): every rank must convert the same model with the same Float8LinearConfig and "
        "module_filter_fn (check rank-dependent flags, environment variables and config files)"
    )


_SEQ: dict[tuple[str, int], int] = {}  # (group key, rank) -> handshakes that rank did


def _store_of(pg: dist.ProcessGroup) -> dist.Store | None:
    """The group's key-value store (None: the fake backend, or no store torch exposes)."""
    if dist.get_backend(pg) == "fake":
        return None
    world = getattr(dist.distributed_c10d, "_world", None)
    entry = getattr(world, "pg_map", {}).get(pg)
    return entry[1] if entry else None


WAIT_VAR = "FSDP_FLOAT8_RANK_WAIT_S"
NOTICE_S = 30.0  # a rank still waiting after this long says so on stderr, once per handshake
_WAIT_CHECKED: dict[str, float] = {}  # the variable's text -> its validated seconds


def _wait_s(store: dist.Store) -> float:
    """How long a rank waits for the others: FSDP_FLOAT8_RANK_WAIT_S (validated once per
    value, at first use), else the store's timeout (the process group's)."""
    text = os.environ.get(WAIT_VAR)
    if text is None:
        return getattr(store, "timeout", dist.default_pg_timeout).total_seconds()
    if text not in _WAIT_CHECKED:
        try:
            seconds = float(text)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(
                f"{WAIT_VAR}={text!r}: expected a finite number of seconds > 0 (how long a "
                "rank waits at a float8 refresh for the other ranks), e.g. 600; unset it to "
                "wait for the process group's timeout"
            )
        _WAIT_CHECKED[text] = seconds
    return _WAIT_CHECKED[text]


class _Waiter:
    """The waits of one handshake: at most `timeout` s in all; once `NOTICE_S` (or half the
    timeout, if shorter) have passed, one line on stderr says what this rank waits for."""

    def __init__(self, store: dist.Store, timeout: float, waiting_for) -> None:
        self.store, self.timeout, self.waiting_for = store, timeout, waiting_for
        self.start = time.monotonic()
        self.notice_at = self.start + min(NOTICE_S, timeout / 2)
        self.said = False

    def wait(self, key: str) -> None:
        if not self.said:
            try:
                self.store.wait([key], self._until(self.notice_at))
                return
            except RuntimeError:  # DistStoreError: not there yet
                self.said = True
                text = f"fsdp_float8: {self.waiting_for()} (waiting up to {self.timeout:g} s)"
                print(text, file=sys.stderr, flush=True)
        self.store.wait([key], self._until(self.start + self.timeout))

    def _until(self, t: float) -> timedelta:
        return timedelta(seconds=max(t - time.monotonic(), 1e-3))


def handshake(pg: dist.ProcessGroup, head: torch.Tensor | None, what: str) -> None:
    """Wait until every rank of `pg` reached the same refresh (`what` names it in errors);
    with `head` (this rank's `fingerprint`), also check that the ranks agree. Nothing to
    check without a usable store (the fake backend)."""
    store = _store_of(pg)
    if store is None:
        return
    timeout = _wait_s(store)
    ranks = dist.get_process_group_ranks(pg)
    me = dist.get_rank()
    key = hashlib.sha256(repr(ranks).encode()).hexdigest()[:16]
    # per rank: ranks that share a process (threaded test process groups) count apart
    seq = _SEQ[key, me] = _SEQ.get((key, me), 0) + 1
    prefix = f"fsdp_float8/handshake/{key}/{seq}"

    def missing() -> list[int]:
        return [r for r in ranks if not store.check([f"{prefix}/{r}"])]

    def waiting_for() -> str:
        return (
            f"rank {me} is waiting at the float8 {what} for ranks {missing()} of {ranks}. "
            + _CAUSES
        )

    mine = "" if head is None else repr(head.tolist())
    store.set(f"{prefix}/{me}", mine)
    waiter = _Waiter(store, timeout, waiting_for)
    try:
        waiter.wait(f"{prefix}/{ranks[0]}")
        if store.get(f"{prefix}/{ranks[0]}").decode() != mine:
            store.add(f"{prefix}/differ", 1)
        if store.add(f"{prefix}/arrived", 1) == len(ranks):
            store.set(f"{prefix}/all", "1")
        waiter.wait(f"{prefix}/all")
    except RuntimeError as e:  # the store's wait timed out
        raise RuntimeError(
            f"rank {me} waited {timeout:g} s at the float8 {what} for ranks {missing()} of "
            f"{ranks}, which never reached it ({e}). {_CAUSES} {WAIT_VAR} sets how long a "
            "rank waits"
        ) from None
    _forget(store, prefix, seq, me, ranks[0])
    # every rank checks, also one that sent no fingerprint (its layers were checked before):
    # a peer that raises would otherwise leave it alone in the refresh collective
    if int(store.add(f"{prefix}/differ", 0)):
        rows = [_row(store.get(f"{prefix}/{r}").decode()) for r in ranks]
        check_agreement(torch.tensor(rows, dtype=torch.float64), pg)


_CAUSES = (
    "Every rank must convert the model alike (convert_to_float8_training before "
    "fully_shard) and run the same float8 calls: an optimizer.step() that some ranks skip "
    "(e.g. a skip decided from a rank's own loss), an explicit precompute / sync, a "
    "checkpoint load or an in-place write into weights on some ranks only starts a "
    "collective the others never join."
)


def _forget(store: dist.Store, prefix: str, seq: int, me: int, first: int) -> None:
    """Delete the keys of handshake seq - 2: every rank is past it, its keys are read."""
    if seq <= 2:
        return
    old = f"{prefix.rpartition('/')[0]}/{seq - 2}"
    store.delete_key(f"{old}/{me}")
    if me == first:
        for name in ("differ", "arrived", "all"):
            store.delete_key(f"{old}/{name}")


def _row(text: str) -> list[float]:
    """A fingerprint row as `handshake` stores it (the repr of a list of floats); -1 in
    every field for a rank that sent none (it had checked this group already)."""
    return [float(v) for v in text.strip("[]").split(",")] if text else [-1.0] * len(FIELDS)
