"""Shared helpers of the benchmark scripts: timing, device peaks, tables, JSON.

Mental model: a benchmark times a zero-argument callable with `time_ms`, which warms it up
and returns the median over `iters` runs (CUDA events on a GPU, `time.perf_counter` on the
CPU, so the number is the device's time, not the launch time), and reports rows that go
both into a markdown table (`markdown_table`) and into a JSON file (`write_json`, written
again after every row so a run cut short by a timeout still leaves its results). Every JSON
file opens with `environment()`: date, torch version, device, threads, git commit.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Dense (no sparsity) peak TFLOP/s of the SXM parts, from NVIDIA's datasheets; the one table
# that benchmarks (% of peak) and the trainer (MFU, against bf16) read. No "fp8": no float8.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100": {"bf16": 989.4, "fp8": 1978.9},
    "H200": {"bf16": 989.4, "fp8": 1978.9},
    "GH200": {"bf16": 989.4, "fp8": 1978.9},
    "A100": {"bf16": 312.0},
    "L40S": {"bf16": 362.0},
    "L4": {"bf16": 121.0},
}


def resolve_device(name: str | None, *, threads: int | None = None) -> torch.device:
    """'cpu', 'cuda' or None (CUDA when available); refuses CUDA on a machine without it.
    `threads`, when given, sets the CPU intra-op thread count (`--threads`)."""
    if threads:
        torch.set_num_threads(threads)
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"--device {name} asked for CUDA, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}); use --device cpu"
        )
    return device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(
    fn: Callable[[], object], device: torch.device, *, warmup: int = 3, iters: int = 10
) -> dict[str, float]:
    """Median, min and max milliseconds of `fn()` after `warmup` untimed calls.

    On the CPU also `cpu_median_ms`: the process CPU time per call (all its threads). On a
    machine shared with other jobs the wall clock includes time spent waiting for a core;
    with one thread (`torch.set_num_threads(1)`) the CPU time does not.
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    times: list[float] = []
    cpu_times: list[float] = []
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for start, end in zip(starts, ends):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        for _ in range(iters):
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            cpu_times.append((time.process_time() - c0) * 1e3)
    out = {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}
    if cpu_times:
        out["cpu_median_ms"] = statistics.median(cpu_times)
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def peak_tflops(device: torch.device) -> dict[str, float] | None:
    """{'bf16': ..., 'fp8': ...} dense peaks for a known GPU (a word of its name, e.g.
    "NVIDIA H200" or "NVIDIA A100-SXM4-80GB"), None otherwise (CPU)."""
    if device.type != "cuda":
        return None
    words = torch.cuda.get_device_name(device).replace("-", " ").split()
    return next((peaks for key, peaks in PEAK_TFLOPS.items() if key in words), None)


def git_commit() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return None
    return f"{sha}{'+dirty' if dirty else ''}" if sha else None


def environment(device: torch.device) -> dict[str, Any]:
    return {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": device_name(device),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "git_commit": git_commit(),
        "command": command_line(),
    }


def command_line() -> str:
    """How this process was started, as `python -m f8train.NAME ...` for a module."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
    return " ".join(head + sys.argv[1:])


def write_json(path: str | os.PathLike | None, payload: dict[str, Any]) -> None:
    """Write atomically (tmp file + rename), so a reader never sees half a file."""
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    tmp.replace(path)


def parse_choices(parser, text: str, known: Sequence[str], what: str) -> list[str]:
    """A comma-separated list of names from `known`; an unknown name is a parser error."""
    names = [n for n in text.split(",") if n]
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown {what} {unknown}; expected some of {list(known)}")
    return names


def fmt(value: Any, spec: str = ".2f") -> str:
    """Format a number for a table; None, NaN and strings pass through readably."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return format(value, spec)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells[1:]]
    return "\n".join(lines)


def short_error(exc: BaseException, limit: int = 160) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reset_compiler() -> None:
    """Forget earlier compiled graphs, so each compiled case is compiled on its own and no
    recompile limit (or automatic dynamic shapes) carries over from the previous case."""
    torch._dynamo.reset()


def _backend_kind(name: str) -> str | None:
    """'gloo:all_reduce' / 'nccl:_all_gather_base' ... -> a CollectiveKind value."""
    backend, _, op = name.partition(":")
    if backend not in ("gloo", "nccl", "mpi", "ucc") or not op:
        return None
    op = op.replace("allreduce", "all_reduce").replace("allgather", "all_gather")
    for kind in ("reduce_scatter", "all_gather", "all_reduce", "broadcast", "all_to_all"):
        if kind in op:
            return kind
    return "other"


class StepProbe:
    """Profiles one step for two figures that a dispatch mode cannot give.

    - `backend_counts`: collectives by kind as the backend ran them (the profiler's
      `gloo:*` / `nccl:*` events). Unlike `CollectiveCounter` this also sees collectives
      that a tensor subclass (DTensor) issues inside its own op dispatch.
    - `peak_mib`: peak memory of the step above what was live when it started. CUDA:
      `torch.cuda.max_memory_allocated`. CPU: every CPU tensor allocation and free the
      profiler saw (`profile_memory=True`), summed in time order; None if unavailable.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.backend_counts: dict[str, int] = {}
        self.peak_mib: float | None = None

    def __enter__(self) -> StepProbe:
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=not cuda)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        self._prof.__exit__(*exc)
        if exc[0] is not None:
            return
        counts: dict[str, int] = {}
        for event in self._prof.events():
            kind = _backend_kind(event.name)
            if kind:
                counts[kind] = counts.get(kind, 0) + 1
        self.backend_counts = counts
        if self.device.type == "cuda":
            self.peak_mib = (torch.cuda.max_memory_allocated(self.device) - self._base) / 2**20
        else:
            self.peak_mib = _cpu_peak_mib(self._prof)


def _cpu_peak_mib(prof) -> float | None:
    try:
        events = prof.profiler.kineto_results.events()
        deltas = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    except Exception:  # a private profiler API: no figure rather than a crash
        return None
    live = peak = 0
    for _, nbytes in deltas:
        live += nbytes
        peak = max(peak, live)
    return peak / 2**20


class HostReads(TorchDispatchMode):
    """Counts `aten._local_scalar_dense` (what `.item()`, `bool(t)`, `float(t)` run): `count`
    all of them, `device_count` those of a non-CPU tensor (each a device sync). On a CPU run
    every read is a CPU read; compare configs against bf16 (the optimizer's own reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.device_count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
            self.device_count += args[0].device.type != "cpu"
        return func(*args, **(kwargs or {}))
