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
  `GPUTarget("cuda", 90 | 100, 32)`;
- `AsyncCompile.triton`: each kernel is compiled by Triton for that target (every
  autotune config, down to cubin with ptxas, or only to Triton's source with
  `cubin=False`) and a stub that refuses to launch is returned;
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


class _StubKernel:
    def __init__(self, name: str):
        self.name = name

    def run(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"gpu_codegen: kernel {self.name} was built, not loaded")


def _triton_driver(props: SimpleNamespace):
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver

    capability = (props.major, props.minor)

    class _Utils:
        def get_device_properties(self, device: int) -> dict:
            return {
                "max_shared_mem": props.shared_memory_per_block_optin,
                "multiprocessor_count": props.multi_processor_count,
                "max_num_regs": props.regs_per_multiprocessor,
                "warpSize": props.warp_size,
            }

        def load_binary(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("gpu_codegen: no driver loads a cubin here")

    class CodegenOnlyDriver(CudaDriver):
        def __init__(self) -> None:  # CudaDriver's own builds its utils against libcuda
            self.utils = _Utils()
            self.launcher_cls = None

        def get_current_target(self) -> Any:
            return GPUTarget("cuda", capability[0] * 10 + capability[1], 32)

        def get_device_capability(self, device: int | None = None) -> tuple[int, int]:
            return capability

        def get_current_device(self) -> int:
            return 0

        def set_current_device(self, device: int) -> None:
            pass

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def is_active(self) -> bool:
            return True

    return CodegenOnlyDriver()


def _cpu_device(d: Any) -> Any:
    if isinstance(d, (torch.device, str)) and torch.device(d).type == "cuda":
        return torch.device("cpu")
    return d


@contextlib.contextmanager
def gpu_codegen(gpu: str = "h100", *, cubin: bool = True) -> Iterator[CodegenLog]:
    """Compile for `gpu` ("h100" or "b200") with no GPU; yields the `CodegenLog`."""
    check_versions()
    import torch._inductor.fx_passes.fuse_attention as fuse_attention
    import torch._inductor.fx_passes.misc_patterns as misc_patterns
    import torch._subclasses.fake_tensor as fake_tensor
    from torch._dynamo.device_interface import CudaInterface
    from torch._inductor import async_compile
    from torch._inductor.constant_folding import ConstantFolder
    from torch._inductor.graph import GraphLowering
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.driver import driver as triton_driver

    props = GPUS[gpu]
    capability = (props.major, props.minor)
    log = CodegenLog()
    original_grad = torch.autograd.grad
    original_compile = GraphLowering.compile_to_module
    original_fold = ConstantFolder.run

    def grad(outputs, inputs, *args, **kwargs):
        if _on_cuda(outputs) or _on_cuda(inputs):
            return python_grad(outputs, inputs, *args, **kwargs)
        return original_grad(outputs, inputs, *args, **kwargs)

    def triton(self, kernel_name: str, source_code: str, device_str: str = "cuda"):
        record: dict = {"name": kernel_name, "src": source_code, "configs": 0}
        if cubin:
            kernel = async_compile._load_triton_kernel_from_source(kernel_name, source_code)
            kernel.precompile(warm_cache_only=True)  # triton.compile per config, no launcher
            record["configs"] = len(kernel.compile_results)
        log.kernels.append(record)
        return _StubKernel(kernel_name)

    def compile_to_module(self):
        module = original_compile(self)
        kind = "backward" if self.is_backward else "inference" if self.is_inference else "forward"
        with open(module.__file__) as f:
            log.graphs.append({"kind": kind, "path": module.__file__, "src": f.read()})
        return module

    class _CudaOnCpu(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            if func is torch.ops.prims.device_put.default:
                args = (args[0], _cpu_device(args[1]), *args[2:])
            return func(*args, **kwargs)

    def fold(self, *args, **kwargs):
        with _CudaOnCpu():
            return original_fold(self, *args, **kwargs)

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
    saved_driver = (triton_driver._default, triton_driver._active)
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context
        for name, value in cuda.items():
            patch(mock.patch.object(torch.cuda, name, value))
        for name, value in interface.items():
            patch(mock.patch.object(CudaInterface, name, staticmethod(value)))
        patch(mock.patch.object(torch.accelerator, "is_available", lambda: False))
        patch(mock.patch.object(fake_tensor, "init_gpu_context", lambda device: None))
        patch(
            mock.patch.object(
                fake_tensor.FakeTensorMode, "avoid_device_init", property(lambda self: True)
            )
        )
        patch(mock.patch.object(fuse_attention, "_sfdp_init", lambda *a, **k: None))
        patch(mock.patch.object(misc_patterns, "_misc_patterns_init", lambda *a, **k: None))
        patch(mock.patch.object(ConstantFolder, "run", fold))
        patch(mock.patch.object(async_compile.AsyncCompile, "triton", triton))
        patch(mock.patch.object(GraphLowering, "compile_to_module", compile_to_module))
        patch(mock.patch.object(torch.autograd, "grad", grad))
        patch(torch._functorch.config.patch(force_non_lazy_backward_lowering=True))
        patch(
            torch._inductor.config.patch(
                force_disable_caches=True, compile_threads=1, benchmark_kernel=True
            )
        )
        torch._C._ensureCUDADeviceGuardSet()
        torch._dynamo.reset()  # nothing compiled for another device or before is reused
        torch._dynamo.utils.counters.clear()  # graph breaks etc. counted from here
        triton_driver._default = triton_driver._active = _triton_driver(props)
        _clear_device_caches()
        try:
            yield log
        finally:
            triton_driver._default, triton_driver._active = saved_driver
            _clear_device_caches()
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()


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
