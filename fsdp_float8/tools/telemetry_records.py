"""Telemetry records on their way from the device to the host, and out to a file.

Mental model: each observed cast leaves one `PendingRecord`, its labels on the host and its
statistics as one small float32 tensor on the operand's device (NaN where a value cannot be
known). Nothing is read while training runs: `host_records` stacks every pending tensor and
reads them in one transfer, turning each into a plain JSON-ready dict (`RECORD_FIELDS`, with
None for NaN). `warn_past_thresholds` then checks a record's saturation and underflow
fractions, and `append_jsonl` writes records out.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fsdp_float8.core.gemms import Gemm, Operand

RECORD_FIELDS = (
    "step",
    "layer",
    "operand",
    "gemm",
    "float8_dtype",
    "amax",
    "scale",
    "scale_max",
    "saturation",
    "underflow",
    "sqnr",
)
_STATS = ("amax", "scale", "scale_max", "saturation", "underflow", "sqnr")


class Float8NumericsWarning(UserWarning):
    """A layer's saturation or underflow fraction crossed a Float8Telemetry threshold."""


@dataclass
class PendingRecord:
    step: int
    layer: str
    operand: Operand
    gemm: Gemm
    float8_dtype: torch.dtype | str
    stats: torch.Tensor  # (6,) float32 on the operand's device, NaN for unknown

    @classmethod
    def of(
        cls,
        step: int,
        layer: str,
        operand: Operand,
        gemm: Gemm,
        float8_dtype: torch.dtype | str,
        stats: torch.Tensor,
    ) -> PendingRecord:
        """A record of `stats`, NaN-padded to every statistic (a float8 cast's has no SQNR)."""
        if stats.numel() < len(_STATS):
            stats = torch.cat([stats, stats.new_full((len(_STATS) - stats.numel(),), math.nan)])
        return cls(step, layer, operand, gemm, float8_dtype, stats)


def host_records(pending: list[PendingRecord]) -> list[dict[str, Any]]:
    """The pending records as plain dicts, read to the host in one transfer."""
    if not pending:
        return []
    device = pending[0].stats.device
    rows = torch.stack([p.stats.to(device) for p in pending]).tolist()  # the host read
    records = []
    for p, row in zip(pending, rows, strict=True):
        record = {
            "step": p.step,
            "layer": p.layer,
            "operand": p.operand.value,
            "gemm": p.gemm.value,
            "float8_dtype": str(p.float8_dtype).replace("torch.float8_", ""),  # or a format
        }
        record.update({k: None if math.isnan(v) else v for k, v in zip(_STATS, row)})
        records.append(record)
    return records


def warn_past_thresholds(
    r: dict[str, Any], saturation_warn: float | None, underflow_warn: float | None
) -> None:
    """A `Float8NumericsWarning` per fraction of `r` above its threshold (None: no check),
    reported at `Float8Telemetry.records` / `flush`, which reach it through `_drain`."""
    for stat, limit in (("saturation", saturation_warn), ("underflow", underflow_warn)):
        value = r[stat]
        if limit is None or value is None or not value > limit:
            continue
        warnings.warn(
            f"{_kind(r['float8_dtype'])} {stat} in {r['layer']} ({r['operand']}, {r['gemm']} GEMM, "
            f"{r['float8_dtype']}) at step {r['step']}: {value:.3g} of elements > "
            f"threshold {limit:g} (amax {r['amax']:.3g}, scale {r['scale']:.3g})",
            Float8NumericsWarning,
            stacklevel=3,
        )


def _kind(dtype_word: str) -> str:
    """What a warning calls a record's cast: float8, or the format's word."""
    return "float8" if dtype_word.startswith(("e4m3", "e5m2")) else dtype_word


def append_jsonl(path: str | Path, records: Iterable[dict[str, Any]]) -> int:
    """Append records (e.g. `tel.flush()`) to a JSONL file; returns how many."""
    lines = [json.dumps(r) + "\n" for r in records]
    with Path(path).open("a") as f:
        f.writelines(lines)
    return len(lines)
