"""What ``f8train/train.py`` records and shows (rank 0 only): ``MetricsFile`` writes
``OUT/metrics.jsonl``, one JSON object per step (on resume the lines after the resumed step
move to ``metrics.dropped.jsonl``, so the file holds each step once and nothing is lost);
``Progress`` prints the step line and messages; ``summary``/``format_summary`` give the
end-of-run figures of ``summary.json``. The fields are listed in docs/trainer.md.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from f8train.bench_common import peak_tflops
from fsdp_float8.tools.comm_stats import CollectiveCounter
from fsdp_float8.tools.telemetry import append_jsonl

_COMM_FIELDS = ("all_gather_bytes", "all_gather_count", "reduce_scatter_bytes", "all_reduce_bytes")


class MetricsFile:
    def __init__(self, path: Path, *, enabled: bool, resume_step: int) -> None:
        self.path, self.enabled = Path(path), enabled
        self.dropped_path = self.path.with_name(self.path.stem + ".dropped.jsonl")
        self.dropped = 0  # lines moved to the dropped file (steps this run trains again)
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        kept, dropped = [], []
        for line in filter(str.strip, lines):
            (kept if resume_step > 0 and _step_of(line) <= resume_step else dropped).append(line)
        if dropped:  # first the copy, then the rewrite: a crash in between loses nothing
            with self.dropped_path.open("a") as f:
                f.write("".join(line + "\n" for line in dropped))
        self.dropped = len(dropped)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.path)

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            append_jsonl(self.path, [record])


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError, TypeError):
        return 1 << 62  # unreadable: never kept as a resumed step, moved with the dropped


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def comm_fields(counter: CollectiveCounter | None) -> dict[str, int | None]:
    """The step record's collective fields (None: not measured this step)."""
    if counter is None:
        return dict.fromkeys(_COMM_FIELDS)
    # gradient reduction: FSDP2's reduce-scatter, or --float8-reduce-scatter's all-to-all
    reduce = counter.bytes("reduce_scatter") + counter.bytes("all_to_all")
    counts = (counter.bytes("all_gather"), counter.count("all_gather"), reduce)
    return dict(zip(_COMM_FIELDS, (*counts, counter.bytes("all_reduce"))))


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
    """Rank 0's output: the step line (step/total, loss, tokens/s, ETA from recent step
    times), in place on a terminal, else every ``log_every`` steps; and messages."""

    def __init__(self, total: int, *, enabled: bool, log_every: int) -> None:
        self.total, self.enabled, self.log_every = total, enabled, max(1, log_every)
        self.live = enabled and sys.stdout.isatty()
        self.open_line = False  # a live step line is on screen, not ended yet
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
            self.open_line = True
        elif step % self.log_every == 0 or step in (1, self.total):
            print(line, flush=True)

    def message(self, text: str) -> None:
        """Lines of their own, below a live step line."""
        if self.enabled:
            print(("\n" if self.open_line else "") + text, flush=True)
            self.open_line = False


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summary(records: list[dict[str, Any]], extra: dict[str, Any]) -> dict[str, Any]:
    """End-of-run figures from the step records; the speed leaves out the first steps
    (warm-up, compilation) when there are enough."""
    if not records:
        return dict(extra)
    timed = records[min(2, len(records) - 1) :]
    vals = [r for r in records if "val_loss" in r]
    seconds = sum(r["step_time_s"] for r in timed)
    return {
        **extra,
        "steps": records[-1]["step"],
        "final_loss": records[-1]["loss"],
        "final_loss_avg10": _mean([r["loss"] for r in records[-10:]]),
        "val_loss": vals[-1]["val_loss"] if vals else None,
        "val_step": vals[-1]["step"] if vals else None,
        # total tokens / total time (a mean of per-step rates would favour fast steps)
        "tokens_per_s": sum(r["tokens_per_s"] * r["step_time_s"] for r in timed) / seconds,
        "step_time_s": seconds / len(timed),
        "all_gather_bytes_per_step": _mean([r.get("all_gather_bytes") for r in records]),
        "reduce_scatter_bytes_per_step": _mean([r.get("reduce_scatter_bytes") for r in records]),
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in records),
        "mfu": _mean([r.get("mfu") for r in timed]),
        "train_time_s": sum(r["step_time_s"] for r in records),
    }


def format_summary(s: dict[str, Any]) -> str:
    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    losses = "-"
    if s.get("final_loss") is not None:
        losses = f"{s['final_loss']:.4f} / {s['final_loss_avg10']:.4f}"
    val_at = "" if s.get("val_step") is None else f" (step {s['val_step']})"
    rows = [
        ("config", s.get("config", "-")),
        ("steps", num(s.get("steps"), "d")),
        ("final train loss (last / avg of 10)", losses),
        ("val loss", num(s.get("val_loss"), ".4f") + val_at),
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
