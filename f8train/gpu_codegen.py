"""Inductor's GPU code generation on a machine without a GPU: kernels built, none executed.

With the CUDA build of torch 2.11.0 (triton 3.6.0 and ptxas come with it) `torch.compile`
lowers a model on FakeTensors placed on `cuda` exactly as it would on one H100 (sm_90) or
one B200 (sm_100): Dynamo, AOTAutograd (forward and backward), Inductor's Triton and
extern-kernel choices, and each Triton kernel built down to a cubin for that target. No
kernel runs; what comes back is the generated wrapper code of every graph, whose `call()`
lists every launch, and each kernel's own estimate of the bytes it moves.

`gpu_codegen("h100")` (a context manager) patches, for its duration only:

- `torch.cuda` and Dynamo's `CudaInterface` device queries (available, one device,
  capability, properties: SM count, shared memory, registers): answered from `GPUS`;
  `torch.accelerator.is_available` is False, so Dynamo does not track the current stream
  (that needs a CUDA context);
- `torch._subclasses.fake_tensor`: no GPU context init, and `avoid_device_init`
  (what FakeTensorMode does by itself when CUDA is absent: a no-op device guard, and
  `torch.tensor(..., device="cuda")` built on the CPU then lifted);
- two lazily registered Inductor pattern families (attention fusion, randperm +
  index_add) that build real cuda tensors while tracing their patterns: not registered;
- Inductor's joint-graph constant folding, which runs 1-element ops for real to learn a
  uniform value: on the CPU instead of cuda (same value; the folded node keeps its meta);
- Triton's active driver: a `CudaDriver` that never loads libcuda, whose target is
  `GPUTarget("cuda", 90 | 100, 32)` (`f8train/gpu_triton.py`);
- `AsyncCompile.triton`: each kernel is compiled by Triton for that target (every
  autotune config, down to cubin with ptxas, or only to Triton's source with
  `cubin=False`) and a stub that refuses to launch is returned (`f8train/gpu_triton.py`);
- `GraphLowering.compile_to_module`: each wrapper module is recorded (`CodegenLog.graphs`);
- `torch._functorch.config.force_non_lazy_backward_lowering`: the backward graph is
  lowered when the forward is compiled, so a forward call yields both;
- Inductor's config: caches off (every graph is lowered afresh), compile in-process, and
  `benchmark_kernel`, which makes each kernel carry Inductor's estimate of the bytes it
  moves (`kernel_num_gb`); Dynamo is reset and its counters cleared on entry and exit;
- `torch.autograd.grad` for cuda tensors: AOTAutograd traces the joint graph with it, and
  the C++ engine asks for a CUDA context on cuda nodes; the walk is done in Python,
  `f8train/gpu_autograd.py`'s `python_grad` (nodes in the engine's order, each gradient
  summed to its input's shape and cast to its dtype).

`codegen_backend(log)` is a `torch.compile` backend that lowers each Dynamo graph with
Inductor (recording it) and then runs the graph eagerly on the fake tensors (under their
fake mode, so a constant the graph makes on cuda is fake too), so a model
whose parts are compiled (FSDP2's hooks outside, each block inside) runs end to end.

Reading what it produced (launches, host syncs, bytes moved, a roofline time) is
`f8train/gpu_kernels.py`'s; those names are importable from here as well.

These are internals of torch 2.11 / triton 3.6; on any other version `gpu_codegen` raises
`RuntimeError` naming the versions it needs. The library's run time never imports this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from f8train.gpu_autograd import python_grad
from f8train.gpu_kernels import (  # noqa: F401  (importable from here as well)
    HOST_SYNCS,
    HP_GEMMS,
    OWN_GEMMS,
    SCALED_GEMMS,
    GraphSummary,
    as_after_first_sync,
    call_body,
    kernel_bytes,
    launches,
    returned_buffer_bytes,
    roofline_seconds,
    summaries,
)
from f8train.gpu_triton import codegen_only_driver, compiling_triton

TORCH_VERSION = "2.11."
TRITON_VERSION = "3.6."


def _props(name: str, major: int, sms: int, memory_gib: int, l2_mib: int) -> SimpleNamespace:
    return SimpleNamespace(
        name=name, major=major, minor=0, multi_processor_count=sms,
        total_memory=memory_gib * 2**30, regs_per_multiprocessor=65536,
        max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32,
        L2_cache_size=l2_mib * 2**20, shared_memory_per_block=49152,
        shared_memory_per_block_optin=232448, shared_memory_per_multiprocessor=233472,
        is_integrated=False, is_multi_gpu_board=False, gcnArchName="", uuid="gpu-codegen",
        pci_bus_id=0, pci_device_id=0, pci_domain_id=0,
    )  # fmt: skip


# The two GPUs the lane lowers for (public datasheet values: SMs, memory, L2).
GPUS = {
    "h100": _props("NVIDIA H100 80GB HBM3", 9, 132, 80, 50),
    "b200": _props("NVIDIA B200", 10, 148, 180, 126),
}


@dataclass
class CodegenLog:
    """What one `gpu_codegen` context produced: Dynamo graphs handed to the backend, each
    Inductor wrapper module (kind, path, source), each Triton kernel compiled."""

    dynamo_graphs: list = field(default_factory=list)
    graphs: list = field(default_factory=list)
    kernels: list = field(default_factory=list)


def check_versions() -> None:
    """Raise RuntimeError unless this is the CUDA build of torch 2.11 with triton 3.6."""
    if not torch.__version__.startswith(TORCH_VERSION) or torch.version.cuda is None:
        raise RuntimeError(
            f"f8train.gpu_codegen patches torch {TORCH_VERSION}x (CUDA build) internals; "
            f"this is torch {torch.__version__} (cuda {torch.version.cuda}). Use the "
            "fake-CUDA venv: make test-gpucodegen"
        )
    import triton

    if not triton.__version__.startswith(TRITON_VERSION):
        raise RuntimeError(
            f"f8train.gpu_codegen patches triton {TRITON_VERSION}x internals; this is "
            f"triton {triton.__version__}"
        )


# ---- the patches ---------------------------------------------------------------------------


def _on_cuda(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return x.device.type == "cuda"
    return isinstance(x, (list, tuple)) and any(_on_cuda(y) for y in x)


def _cpu_device(d: Any) -> Any:
    if isinstance(d, (torch.device, str)) and torch.device(d).type == "cuda":
        return torch.device("cpu")
    return d


class _CudaOnCpu(TorchDispatchMode):
    """Ops told to make a tensor on cuda, or to move one there, use the CPU instead."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if func is torch.ops.prims.device_put.default:
            args = (args[0], _cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


def _device_queries(props: SimpleNamespace) -> tuple[dict[str, Callable], dict[str, Callable]]:
    """`torch.cuda`'s and Dynamo's `CudaInterface`'s answers for the one device `props`."""
    capability = (props.major, props.minor)
    cuda = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "get_device_capability": lambda device=None: capability,
        "get_device_properties": lambda device=None: props,
        "get_device_name": lambda device=None: props.name,
        "is_bf16_supported": lambda *a, **k: True,
        "_exchange_device": lambda device: 0,
        "_maybe_exchange_device": lambda device: 0,
        "_lazy_init": lambda: None,
        "get_rng_state": lambda *a, **k: torch.zeros(16, dtype=torch.uint8),
        "set_rng_state": lambda *a, **k: None,
    }
    interface = {
        "is_available": lambda: True,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "device_count": lambda: 1,
        "get_device_properties": lambda device=None: props,
        "exchange_device": lambda device: 0,
        "maybe_exchange_device": lambda device: 0,
        "is_bf16_supported": lambda *a, **k: True,
        "get_compute_capability": lambda device=None: capability[0] * 10 + capability[1],
    }
    return cuda, interface


def _device_patches(props: SimpleNamespace) -> list[contextlib.AbstractContextManager]:
    """A GPU that answers every query and is never initialised: `torch.cuda` and Dynamo's
    `CudaInterface` report `props`, `torch.accelerator` none, FakeTensorMode no GPU context."""
    import torch._subclasses.fake_tensor as fake_tensor
    from torch._dynamo.device_interface import CudaInterface

    cuda, interface = _device_queries(props)
    return [
        *(mock.patch.object(torch.cuda, name, value) for name, value in cuda.items()),
        *(mock.patch.object(CudaInterface, n, staticmethod(v)) for n, v in interface.items()),
        mock.patch.object(torch.accelerator, "is_available", lambda: False),
        mock.patch.object(fake_tensor, "init_gpu_context", lambda device: None),
        mock.patch.object(
            fake_tensor.FakeTensorMode, "avoid_device_init", property(lambda self: True)
        ),
    ]


def _recording_lowering(log: CodegenLog, original: Callable) -> Callable:
    """`GraphLowering.compile_to_module`'s stand-in: the original, its module noted in `log`."""

    def compile_to_module(self):
        module = original(self)
        kind = "backward" if self.is_backward else "inference" if self.is_inference else "forward"
        with open(module.__file__) as f:
            log.graphs.append({"kind": kind, "path": module.__file__, "src": f.read()})
        return module

    return compile_to_module


def _folding_on_cpu(original: Callable) -> Callable:
    """`ConstantFolder.run`'s stand-in: the original with cuda placements made on the CPU."""

    def fold(self, *args, **kwargs):
        with _CudaOnCpu():
            return original(self, *args, **kwargs)

    return fold


def _python_grad_on_cuda(original: Callable) -> Callable:
    """`torch.autograd.grad`'s stand-in: the Python walk for cuda tensors, else the original."""

    def grad(outputs, inputs, *args, **kwargs):
        if _on_cuda(outputs) or _on_cuda(inputs):
            return python_grad(outputs, inputs, *args, **kwargs)
        return original(outputs, inputs, *args, **kwargs)

    return grad


def _lowering_patches(log: CodegenLog, cubin: bool) -> list[contextlib.AbstractContextManager]:
    """Inductor's lowering with no GPU (the module docstring lists each patch), every Triton
    kernel and wrapper module it produces recorded in `log`."""
    import torch._inductor.fx_passes.fuse_attention as fuse_attention
    import torch._inductor.fx_passes.misc_patterns as misc_patterns
    from torch._inductor import async_compile
    from torch._inductor.constant_folding import ConstantFolder
    from torch._inductor.graph import GraphLowering

    triton = compiling_triton(log.kernels, cubin)
    lowering = _recording_lowering(log, GraphLowering.compile_to_module)
    return [
        mock.patch.object(fuse_attention, "_sfdp_init", lambda *a, **k: None),
        mock.patch.object(misc_patterns, "_misc_patterns_init", lambda *a, **k: None),
        mock.patch.object(ConstantFolder, "run", _folding_on_cpu(ConstantFolder.run)),
        mock.patch.object(async_compile.AsyncCompile, "triton", triton),
        mock.patch.object(GraphLowering, "compile_to_module", lowering),
        mock.patch.object(torch.autograd, "grad", _python_grad_on_cuda(torch.autograd.grad)),
        torch._functorch.config.patch(force_non_lazy_backward_lowering=True),
        torch._inductor.config.patch(
            force_disable_caches=True, compile_threads=1, benchmark_kernel=True
        ),
    ]


@contextlib.contextmanager
def _codegen_driver(props: SimpleNamespace) -> Iterator[None]:
    """Triton's active driver the codegen-only one for `props` (the saved one back on exit);
    Dynamo reset, its counters cleared and Inductor's device caches emptied both ways."""
    from triton.runtime.driver import driver as triton_driver

    saved_driver = (triton_driver._default, triton_driver._active)
    torch._dynamo.reset()  # nothing compiled for another device or before is reused
    torch._dynamo.utils.counters.clear()  # graph breaks etc. counted from here
    triton_driver._default = triton_driver._active = codegen_only_driver(props)
    _clear_device_caches()
    try:
        yield
    finally:
        triton_driver._default, triton_driver._active = saved_driver
        _clear_device_caches()
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()


@contextlib.contextmanager
def gpu_codegen(gpu: str = "h100", *, cubin: bool = True) -> Iterator[CodegenLog]:
    """Compile for `gpu` ("h100" or "b200") with no GPU; yields the `CodegenLog`."""
    check_versions()
    props = GPUS[gpu]
    log = CodegenLog()
    patches = [*_device_patches(props), *_lowering_patches(log, cubin)]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        torch._C._ensureCUDADeviceGuardSet()
        with _codegen_driver(props):
            yield log


def _clear_device_caches() -> None:
    """Inductor caches what it learns of the device; a new GPU starts afresh."""
    from torch._dynamo import device_interface
    from torch._inductor import utils

    for name in ("is_big_gpu", "get_gpu_shared_memory", "get_max_y_grid", "get_num_sms"):
        cached = getattr(utils, name, None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    device_interface.caching_worker_device_properties.pop("cuda", None)


def codegen_backend(log: CodegenLog) -> Callable:
    """A `torch.compile` backend: lowers each Dynamo graph with Inductor (forward and, by
    `gpu_codegen`'s setting, backward), notes the graph, then runs it eagerly."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        log.dynamo_graphs.append(gm)
        try:
            compile_fx(gm, example_inputs)
        except RuntimeError as err:  # Inductor may run its compiled forward once: no driver
            if "gpu_codegen" not in str(err):
                raise

        def run(*args: Any) -> Any:  # under the fake mode of the tensors it is given
            mode = next(
                (t.fake_mode for t in args if isinstance(t, torch._subclasses.FakeTensor)), None
            )
            active = torch._guards.detect_fake_mode()
            with contextlib.nullcontext() if mode is None or mode is active else mode:
                return gm.forward(*args)

        return run

    return backend
