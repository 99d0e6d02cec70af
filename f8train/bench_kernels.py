"""Where one training step's time goes: GEMMs against everything else, from the profiler.

Mental model: a float8 linear layer is worth its casts only if the GEMMs' saving is not
eaten by the work around them (amax reductions, scale math, casts, transposes). The speedup
target (float8 forward + backward >= 1.5x bf16) therefore splits into two numbers that
say what to tune: the GEMM time, and the time of everything else. `kernel_breakdown(step,
device)` profiles one call of `step` and returns both.

- CUDA: every kernel the step launched, by its own GPU time; a kernel is a GEMM when its
  name says so (cuBLAS/cuBLASLt/CUTLASS names: `gemm`, `nvjet`, `xmma`, `cutlass`,
  `wgmma`). `kernels` counts launches (each non-GEMM launch is also a launch overhead).
- CPU: the CPU time of the outermost GEMM ops (`aten::mm`, `aten::_scaled_mm`, ...,
  children included: on the CPU `_scaled_mm` dequantizes inside), against the step's wall
  time. Compiled CPU kernels are plain CPU work, so they land in `other_ms`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

GEMM_KERNEL_WORDS = ("gemm", "nvjet", "xmma", "cutlass", "wgmma")
GEMM_OPS = ("aten::mm", "aten::_scaled_mm", "aten::addmm", "aten::bmm", "aten::matmul")


def _is_gemm_kernel(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in GEMM_KERNEL_WORDS)


def kernel_breakdown(step: Callable[[], object], device: torch.device) -> dict:
    """Profile one `step()`: {gemm_ms, other_ms, gemm_share, kernels, top} (see module doc)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize(device)
    events = list(prof.events())
    if cuda:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        times = [(e.name, e.time_range.elapsed_us() / 1e3) for e in kernels]
        gemm = sum(t for name, t in times if _is_gemm_kernel(name))
        total = sum(t for _, t in times)
        count: int | None = len(kernels)
    else:
        top_level = [e for e in events if e.cpu_parent is None]
        total = sum(e.time_range.elapsed_us() for e in top_level) / 1e3
        gemm = sum(e.cpu_time_total for e in events if _outermost_gemm(e)) / 1e3
        times = [(e.name, e.self_cpu_time_total / 1e3) for e in events]
        count = None
    by_name: dict[str, float] = {}
    for name, t in times:
        by_name[name] = by_name.get(name, 0.0) + t
    top = dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:6])
    other = max(total - gemm, 0.0)
    return {
        "gemm_ms": gemm,
        "other_ms": other,
        "gemm_share": gemm / total if total else None,
        "kernels": count,
        "top_ms": {_short(k): round(v, 3) for k, v in top.items()},
    }


def _outermost_gemm(event) -> bool:
    if event.name not in GEMM_OPS:
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in GEMM_OPS:
            return False
        parent = parent.cpu_parent
    return True


def _short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."
