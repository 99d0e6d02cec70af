"""What ``f8train/train.py`` shows and records (rank 0 only).

- ``MetricsFile``: ``OUT/metrics.jsonl``, one JSON object per training step (see
  ``STEP_FIELDS``); a step that ran validation also carries ``val_loss``. On resume the
  lines after the resumed step (all of them on a fresh start) move to
  ``metrics.dropped.jsonl`` (appended, never lost), so the file holds each step once.
- ``Progress``: one live line per step on a terminal (``\\r``), otherwise a line every
  ``log_every`` steps, so that log files stay readable.
- ``summary``/``format_summary``: the end-of-run table, also written to ``summary.json``.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from f8train.bench_common import peak_tflops
from fsdp_float8.tools.comm_stats import CollectiveCounter

STEP_FIELDS = (
    "step",  # 1-based, the optimizer steps done
    "loss",  # mean training loss over the global batch
    "lr",
    "grad_norm",  # before clipping
    "tokens_per_s",  # global tokens / step_time_s
    "step_time_s",
    "all_gather_bytes",  # this rank's all-gather input bytes in the step (None: not measured)
    "all_gather_count",
    "reduce_scatter_bytes",
    "all_reduce_bytes",
    "peak_memory_bytes",  # rank 0: CUDA max_memory_allocated, or the process's max RSS
    "mfu",  # CUDA only: model FLOPs utilization against the bf16 dense peak
)


class MetricsFile:
    def __init__(self, path: Path, *, enabled: bool, resume_step: int) -> None:
        self.path = Path(path)
        self.enabled = enabled
        self.dropped = 0  # lines moved to the dropped file (steps this run trains again)
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists():
            self.path.write_text("")
            return
        kept, dropped = [], []
        for line in self.path.read_text().splitlines():
            if line.strip():
                ok = resume_step > 0 and _step_of(line) <= resume_step
                (kept if ok else dropped).append(line)
        if dropped:  # first the copy, then the rewrite: a crash in between loses nothing
            with self.dropped_path.open("a") as f:
                f.write("".join(line + "\n" for line in dropped))
        self.dropped = len(dropped)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.path)

    @property
    def dropped_path(self) -> Path:
        return self.path.with_name(self.path.stem + ".dropped.jsonl")

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError, TypeError):
        return 1 << 62  # unreadable: never kept as a resumed step, moved with the dropped


def comm_fields(counter: CollectiveCounter | None) -> dict[str, int | None]:
    """The step record's collective fields from a ``CollectiveCounter`` (None: not measured)."""
    if counter is None:
        names = ("all_gather_bytes", "all_gather_count", "reduce_scatter_bytes", "all_reduce_bytes")
        return dict.fromkeys(names)
    return {
        "all_gather_bytes": counter.bytes("all_gather"),
        "all_gather_count": counter.count("all_gather"),
        # gradient reduction: FSDP2's reduce-scatter, or the all-to-all that
        # --float8-reduce-scatter sends instead
        "reduce_scatter_bytes": counter.bytes("reduce_scatter") + counter.bytes("all_to_all"),
        "all_reduce_bytes": counter.bytes("all_reduce"),
    }


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    """Per-device bf16 dense peak for MFU; None on CPU or an unknown GPU."""
    if override_tflops:
        return override_tflops * 1e12
    peaks = peak_tflops(device)  # None on CPU
    return peaks["bf16"] * 1e12 if peaks else None


def fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


class Progress:
    """Rank-0 progress line: step/total, loss, tokens/s, ETA from recent step times."""

    def __init__(self, total: int, *, enabled: bool, log_every: int) -> None:
        self.total = total
        self.enabled = enabled
        self.log_every = max(1, log_every)
        self.live = enabled and sys.stdout.isatty()
        self.recent: list[float] = []

    def step(self, record: dict[str, Any]) -> None:
        self.recent = (self.recent + [record["step_time_s"]])[-20:]
        if not self.enabled:
            return
        step = record["step"]
        eta = sum(self.recent) / len(self.recent) * (self.total - step)
        line = (
            f"step {step:>{len(str(self.total))}}/{self.total} | loss {record['loss']:.4f} | "
            f"lr {record['lr']:.2e} | {record['tokens_per_s']:,.0f} tok/s | "
            f"{record['step_time_s']:.3f} s/step | ETA {fmt_duration(eta)}"
        )
        if self.live:
            print("\r" + line, end="", flush=True)
        elif step % self.log_every == 0 or step in (1, self.total):
            print(line, flush=True)

    def message(self, text: str) -> None:
        """A line of its own (validation, checkpoint), not overwritten by the next step."""
        if self.enabled:
            print(("\n" if self.live else "") + text, flush=True)

    def close(self) -> None:
        if self.enabled and self.live:
            print(flush=True)


def summary(records: list[dict[str, Any]], extra: dict[str, Any]) -> dict[str, Any]:
    """End-of-run figures from the step records (the first steps, which include warm-up
    and compilation, are left out of the speed averages when there are enough steps)."""
    if not records:
        return dict(extra)
    skip = min(2, len(records) - 1)
    timed = records[skip:]
    measured = [r["all_gather_bytes"] for r in records if r.get("all_gather_bytes") is not None]
    rs = [r["reduce_scatter_bytes"] for r in records if r.get("reduce_scatter_bytes") is not None]
    vals = [r for r in records if "val_loss" in r]
    last = records[-10:]
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {
        **extra,
        "steps": records[-1]["step"],
        "final_loss": records[-1]["loss"],
        "final_loss_avg10": sum(r["loss"] for r in last) / len(last),
        "val_loss": vals[-1]["val_loss"] if vals else None,
        "val_step": vals[-1]["step"] if vals else None,
        # total tokens / total time (a mean of per-step rates would favour fast steps)
        "tokens_per_s": sum(r["tokens_per_s"] * r["step_time_s"] for r in timed)
        / sum(r["step_time_s"] for r in timed),
        "step_time_s": sum(r["step_time_s"] for r in timed) / len(timed),
        "all_gather_bytes_per_step": sum(measured) / len(measured) if measured else None,
        "reduce_scatter_bytes_per_step": sum(rs) / len(rs) if rs else None,
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in records),
        "mfu": sum(mfus) / len(mfus) if mfus else None,
    }


def format_summary(s: dict[str, Any]) -> str:
    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    rows = [
        ("config", s.get("config", "-")),
        ("steps", num(s.get("steps"), "d")),
        ("final train loss (last / avg of 10)", _pair(s)),
        ("val loss", num(s.get("val_loss"), ".4f") + _at(s.get("val_step"))),
        ("tokens/s (global)", num(s.get("tokens_per_s"), ",.0f")),
        ("step time", num(s.get("step_time_s"), ".3f") + " s"),
        ("all-gather bytes/step (rank 0)", fmt_bytes(s.get("all_gather_bytes_per_step"))),
        ("reduce-scatter bytes/step (rank 0)", fmt_bytes(s.get("reduce_scatter_bytes_per_step"))),
        ("peak memory (rank 0)", fmt_bytes(s.get("peak_memory_bytes"))),
        ("MFU", "-" if s.get("mfu") is None else f"{100 * s['mfu']:.1f}%"),
        ("time in training steps", fmt_duration(s.get("train_time_s", float("nan")))),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _pair(s: dict[str, Any]) -> str:
    if s.get("final_loss") is None:
        return "-"
    return f"{s['final_loss']:.4f} / {s['final_loss_avg10']:.4f}"


def _at(step: int | None) -> str:
    return "" if step is None else f" (step {step})"


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
