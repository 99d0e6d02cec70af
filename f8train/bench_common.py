"""Shared helpers of the benchmark scripts: CLI, timing, device peaks, tables, JSON.

A benchmark times a zero-argument callable with `time_ms` (the median of `iters` calls after
`warmup`: CUDA events on a GPU, wall and process CPU time on the CPU) and hands each result
row to a `Report`, which prints the row as a table line and rewrites the JSON file at once,
so a run cut short keeps every row it measured. Every JSON file opens with `environment()`.
Counting ops and the bytes they write is `f8train.op_counter`'s; its `OpCounter` is
importable from here as well.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from f8train.op_counter import (  # noqa: F401  (importable from here as well)
    GEMM_OPS,
    OpCounter,
    written_bytes,
)

# Dense (no sparsity) peak TFLOP/s of the SXM parts, from NVIDIA's datasheets; the one table
# that benchmarks (% of peak) and the trainer (MFU, against bf16) read. No "fp8": no float8.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100": {"bf16": 989.4, "fp8": 1978.9},
    "H200": {"bf16": 989.4, "fp8": 1978.9},
    "GH200": {"bf16": 989.4, "fp8": 1978.9},
    "A100": {"bf16": 312.0},
    "L40S": {"bf16": 362.0},
    "L4": {"bf16": 121.0},
    "B200": {"bf16": 2250.0, "fp8": 4500.0, "fp4": 9000.0},  # HGX B200, 1,000 W
}
# HBM bandwidth (TB/s) of the same parts, for the roofline of `count_kernels --gpu`.
PEAK_HBM_TBPS: dict[str, float] = {"H100": 3.35, "H200": 4.8, "B200": 8.0}
Column = tuple[str, Callable[[dict], str]]


def peak_tflops(device: torch.device) -> dict[str, float] | None:
    """Dense peaks of a known GPU, matched by a word of its name ("NVIDIA A100-SXM4-80GB"
    is A100, "NVIDIA L4" is not L40S); None on the CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    words = torch.cuda.get_device_name(device).replace("-", " ").split()
    return next((peaks for key, peaks in PEAK_TFLOPS.items() if key in words), None)


def bench_parser(doc: str | None, *, timing: bool = True) -> argparse.ArgumentParser:
    """The flags every benchmark takes (`timing`: also --threads, --warmup, --iters)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few iterations (smoke)")
    p.add_argument("--json", default=None, help="write the results here")
    if timing:
        p.add_argument("--threads", type=int, default=None, help="CPU intra-op threads")
        p.add_argument("--warmup", type=int, default=None)
        p.add_argument("--iters", type=int, default=None)
    return p


def resolve_device(name: str | None, *, threads: int | None = None) -> torch.device:
    """'cpu', 'cuda' or None (CUDA when available); refuses CUDA on a machine without it."""
    if threads:
        torch.set_num_threads(threads)
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"--device {name} asked for CUDA, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}); use --device cpu"
        )
    return device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device, *, warmup=3, iters=10) -> dict[str, float]:
    """Median, min and max ms of `fn()` after `warmup` untimed calls. On the CPU also
    `cpu_median_ms`, the process CPU time per call: with one thread it leaves out the time
    spent waiting for a core on a machine shared with other jobs."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    cpu = None
    if device.type == "cuda":
        pairs = [[torch.cuda.Event(enable_timing=True) for _ in "se"] for _ in range(iters)]
        for start, end in pairs:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in pairs]
    else:
        clocks = []
        for _ in range(iters):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            clocks.append(((time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3))
        times, cpu = zip(*clocks)
    out = {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}
    return out if cpu is None else out | {"cpu_median_ms": statistics.median(cpu)}


def environment(device: torch.device) -> dict[str, Any]:
    """Date, versions, device, threads, commit ('+dirty' with local changes) and command."""
    try:
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty=+dirty", "--exclude=*"],
            cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
    except OSError:
        commit = ""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
    cuda_name = device.type == "cuda" and torch.cuda.get_device_name(device)
    return {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": cuda_name or platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "git_commit": commit or None,
        "command": " ".join(head + sys.argv[1:]),
    }


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
    if unknown or not names:
        parser.error(f"unknown {what} {unknown}; expected some of {list(known)}")
    return names


def parse_dims(parser, flag: str, text: str, arity: int) -> list[tuple[int, ...]]:
    """'AxB,AxB' (`arity` numbers each) as tuples; anything else is a parser error."""
    try:
        dims = [tuple(int(v) for v in spec.lower().split("x")) for spec in text.split(",")]
    except ValueError:
        dims = []
    if not dims or any(len(d) != arity for d in dims):
        example = "x".join(["4096"] * arity)
        parser.error(
            f"{flag} {text!r}: expected {arity} sizes joined by 'x', comma-separated, e.g. {example}"
        )
    return dims


def fmt(value: Any, spec: str = ".2f") -> str:
    """A number for a table; None, NaN and strings pass through readably."""
    if value is None or isinstance(value, str | bool):
        return "-" if value is None else str(value)
    return "nan" if isinstance(value, float) and math.isnan(value) else format(value, spec)


def column(header: str, key: str, spec: str = ".2f") -> Column:
    return header, lambda row: fmt(row.get(key), spec)


ERROR: Column = ("error", lambda row: row.get("error") or "")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    return "\n".join([lines[0], "|" + "|".join("-" * (w + 2) for w in widths) + "|", *lines[1:]])


class Report:
    """The JSON payload of a run (`args` as its settings, `args.json` its file): `add(row)`
    stores a result row, prints it as a table line and rewrites the file; `done()` prints
    the whole table and returns the payload."""

    def __init__(self, benchmark, device, args, columns: list[Column], **fields) -> None:
        self.path, self.columns = args.json, columns
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        self.payload = {"benchmark": benchmark, "environment": environment(device)}
        self.payload |= {"settings": settings, **fields, "results": []}

    def cells(self, row: dict) -> list[str]:
        return [cell(row) for _, cell in self.columns]

    def add(self, row: dict) -> None:
        self.payload["results"].append(row)
        print(" | ".join(self.cells(row)), flush=True)
        write_json(self.path, self.payload)

    def done(self) -> dict:
        rows = [self.cells(r) for r in self.payload["results"]]
        print("\n" + markdown_table([h for h, _ in self.columns], rows))
        write_json(self.path, self.payload)
        return self.payload


def short_error(exc: BaseException, limit: int = 160) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def torchao_error() -> str | None:
    """None when torchao's float8 imports (it is no dependency), else why not."""
    try:
        import torchao.float8  # noqa: F401
    except Exception as exc:
        return short_error(exc)
    return None


@contextlib.contextmanager
def step_probe(device: torch.device) -> Iterator[dict]:
    """Profiles one step for two figures a dispatch mode cannot give: `backend_counts`,
    collectives by kind as the backend ran them (the profiler's `gloo:*`/`nccl:*` events,
    which also see what DTensor issues inside its own ops), and `peak_mib`, the step's peak
    memory above what was live at its start (CUDA: the allocator's peak; CPU: the profiler's
    allocation events summed in time order; None if unavailable)."""
    from torch.profiler import ProfilerActivity, profile

    cuda, figures = device.type == "cuda", {}
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=not cuda) as prof:
        yield figures
        synchronize(device)
    kinds = (_backend_kind(e.name) for e in prof.events())
    figures["backend_counts"] = Counter(kind for kind in kinds if kind)
    if cuda:
        figures["peak_mib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    else:
        figures["peak_mib"] = _cpu_peak_mib(prof)


def _backend_kind(name: str) -> str | None:
    """'gloo:all_reduce', 'nccl:_all_gather_base', ... -> a collective kind."""
    backend, _, op = name.partition(":")
    if backend not in ("gloo", "nccl", "mpi", "ucc") or not op:
        return None
    op = op.replace("allreduce", "all_reduce").replace("allgather", "all_gather")
    kinds = ("reduce_scatter", "all_gather", "all_reduce", "broadcast", "all_to_all")
    return next((kind for kind in kinds if kind in op), "other")


def _cpu_peak_mib(prof) -> float | None:
    try:
        events = prof.profiler.kineto_results.events()
        deltas = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    except Exception:  # a private profiler API: no figure rather than a crash
        return None
    return max(itertools.accumulate(n for _, n in deltas), default=0) / 2**20
