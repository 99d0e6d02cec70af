"""Reading the GPU code `f8train/gpu_codegen.py` generated: what each graph launches and moves.

A wrapper module's `call()` lists every launch in order (`call_body`): Triton kernels
(`.run(` calls), extern kernels and aten fallbacks by name, the GEMMs among them by op
(`launches`; this library's own GEMM ops counted as the aten GEMM each one is), and the
host syncs it makes. Each Triton kernel carries Inductor's estimate of the bytes it moves
(`kernel_bytes`), and a forward graph's returned buffers are what it keeps for the
backward (`returned_buffer_bytes`). `GraphSummary` holds these per graph of a
`CodegenLog` (`summaries`); `roofline_seconds` turns bytes and GEMM FLOPs into a time.
`as_after_first_sync` puts a model's delayed scaling where a training run has it after
its first sync, before the model is lowered.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import torch

_CALL = re.compile(r"\n    def call\(self, args\):\n(.*?)\n(?:runner = |\S)", re.S)
_CALL_FN = re.compile(r"\ndef call\(args\):\n(.*?)\n\S", re.S)
SCALED_GEMMS = ("_scaled_mm", "_scaled_mm_v2", "_scaled_grouped_mm")
HP_GEMMS = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm")
# this library's own GEMM ops, by the aten GEMM each one is
OWN_GEMMS = {"mm_outside_autocast": "mm"}
HOST_SYNCS = ("_local_scalar_dense", ".item()", ".cpu()", ".tolist()", "device(type='cpu')")


def as_after_first_sync(model: torch.nn.Module) -> int:
    """Mark every delayed-scaling operand of `model` synced on the host, as a training run
    has it from the step after its first sync (`DelayedState.ready`, set there from a read
    of the device flags; a fake tensor has no value to read). Returns how many layers."""
    from fsdp_float8.core.delayed_state import DelayedScalingState

    layers = [m for m in model.modules() if isinstance(m, DelayedScalingState)]
    for state in layers:
        state.mark_ready(list(state.operands), [True] * len(state.operands), state.epoch)
    return len(layers)


def call_body(src: str) -> str:
    """The body of a wrapper module's `call()`: every launch, in order."""
    match = _CALL.search(src) or _CALL_FN.search(src)
    return match.group(1) if match else ""


def launches(src: str) -> dict:
    """Launches in a wrapper module: Triton kernels, extern kernels and aten fallbacks by
    name, and GEMMs by op (`_scaled_mm`, `mm`, ...)."""
    body = call_body(src)
    triton = re.findall(r"^\s+(\w+)\.run\(", body, re.M)
    extern = re.findall(r"extern_kernels\.(\w+)\(", body)
    fallback = re.findall(r"torch\.ops\.\w+\.(\w+)\.\w+\(", body)
    ops = [OWN_GEMMS.get(op, op) for op in extern + fallback]
    gemms = Counter(op for op in ops if op in SCALED_GEMMS + HP_GEMMS)
    syncs = [s for s in HOST_SYNCS if s in body]
    return {"triton": triton, "extern": extern, "fallback": fallback, "gemms": gemms,
            "host_syncs": syncs}  # fmt: skip


_ALLOC = re.compile(r"^\s+(\w+) = empty_strided_cuda\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)", re.M)


def returned_buffer_bytes(src: str) -> int:
    """Bytes of the buffers a wrapper allocates and returns: for a forward graph, what it
    keeps for the backward beyond its inputs (the activations it saves)."""
    body = call_body(src)
    returns = [line for line in body.splitlines() if line.strip().startswith("return ")]
    if not returns:
        return 0
    names = set(re.findall(r"\b\w+\b", returns[-1].split("return ", 1)[1]))
    total = 0
    for name, dims, dtype in _ALLOC.findall(body):
        if name in names:
            numel = math.prod(int(d) for d in dims.split(",") if d.strip())
            total += numel * getattr(torch, dtype).itemsize
    return total


def kernel_bytes(src: str) -> int:
    """Inductor's own estimate of the bytes a Triton kernel moves (its `inductor_meta`'s
    `kernel_num_gb`, written when `benchmark_kernel` is on), in bytes."""
    match = re.search(r"'kernel_num_gb': ([0-9.e+-]+)", src)
    return round(float(match.group(1)) * 1e9) if match else 0


def _kernel_sources(src: str) -> dict[str, str]:
    """Each Triton kernel a wrapper module defines: name -> source."""
    pattern = re.compile(r"^(\w+) = async_compile\.triton\('(\w+)', '''(.*?)'''", re.S | re.M)
    return {m.group(1): m.group(3) for m in pattern.finditer(src)}


@dataclass
class GraphSummary:
    """One generated graph: its launches, GEMMs and the bytes its Triton kernels move."""

    kind: str
    triton: int
    gemms: Counter
    extern: list
    fallback: list
    host_syncs: list
    triton_bytes: int
    saved_bytes: int  # forward: the buffers it returns for the backward

    @classmethod
    def of(cls, graph: dict) -> GraphSummary:
        found = launches(graph["src"])
        sources = _kernel_sources(graph["src"])
        moved = sum(kernel_bytes(sources.get(name, "")) for name in found["triton"])
        saved = returned_buffer_bytes(graph["src"])
        return cls(graph["kind"], len(found["triton"]), found["gemms"], found["extern"],
                   found["fallback"], found["host_syncs"], moved, saved)  # fmt: skip


class _Graphs(Protocol):
    """What `summaries` reads of a `gpu_codegen.CodegenLog`: its generated graphs."""

    graphs: list[dict]


def summaries(log: _Graphs) -> list[GraphSummary]:
    return [GraphSummary.of(g) for g in log.graphs]


# ---- a roofline of the generated step ------------------------------------------------------
# The peaks are bench_common's one table (dense, from the datasheets): H100 SXM5 3.35 TB/s,
# 989.4 TFLOP/s bf16, 1,978.9 fp8; HGX B200 8 TB/s, 2,250 bf16, 4,500 fp8, 9,000 fp4.
_PART = {"h100": "H100", "b200": "B200"}


def roofline_seconds(gpu: str, nongemm_bytes: int, gemm_flops: dict[str, float]) -> float:
    """Non-GEMM bytes at HBM bandwidth plus each GEMM dtype's FLOPs at its dense peak:
    no overlap, no launch cost, GEMMs at 100% of peak."""
    from f8train.bench_common import PEAK_HBM_TBPS, PEAK_TFLOPS

    part = _PART[gpu]
    seconds = nongemm_bytes / (PEAK_HBM_TBPS[part] * 1e12)
    return seconds + sum(f / (PEAK_TFLOPS[part][d] * 1e12) for d, f in gemm_flops.items())
