"""Do all ranks run the same float8 model? A fixed-length fingerprint, checked once.

Ranks that convert differently (another recipe, scaling type, static scale, float8
all-gather on one rank only, another module filter) would otherwise hang in a collective,
abort in gloo, or train silently wrong. `fingerprint(layers)` hashes each setting over
every linear and expert weight into one float64 per field (52-bit hashes, exact in float64; the
number of fields does not depend on the model), so the first refresh collective of a group
can carry it (`fsdp_float8.fsdp.step`), and `check_agreement` raises on every rank, naming each
field that differs and the ranks that hold each value.
"""

from __future__ import annotations

import dataclasses
import hashlib

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
