"""Triton with no GPU: kernels compiled for a chosen GPU's target, none loaded or launched.

`codegen_only_driver(props)` is a `CudaDriver` that never opens libcuda. Its target is
`GPUTarget("cuda", 90 | 100, 32)` from the capability in `props` (an entry of
`f8train.gpu_codegen.GPUS`), the device properties Triton's compiler asks for (shared
memory, SMs, registers, warp size) come from `props` too, and loading a binary raises.
`compiling_triton(kernels, cubin)` stands in for Inductor's `AsyncCompile.triton`: each
kernel is compiled by Triton against the active driver's target (every autotune config down
to a cubin with ptxas; with `cubin=False` only its source is kept), noted in `kernels`, and
answered with a stub that refuses to run. `f8train.gpu_codegen` installs both for the
length of its context. Triton is imported inside these functions only.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any


class _StubKernel:
    def __init__(self, name: str):
        self.name = name

    def run(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"gpu_codegen: kernel {self.name} was built, not loaded")


def codegen_only_driver(props: SimpleNamespace):
    """Triton's CUDA driver for the GPU `props` describes, with no CUDA driver under it."""
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


def compiling_triton(kernels: list[dict], cubin: bool) -> Callable:
    """`AsyncCompile.triton`'s stand-in: compiles the kernel for the current Triton target
    (`cubin`: every autotune config down to cubin), notes it in `kernels`, returns a stub."""
    from torch._inductor import async_compile

    def triton(self, kernel_name: str, source_code: str, device_str: str = "cuda"):
        record: dict = {"name": kernel_name, "src": source_code, "configs": 0}
        if cubin:
            kernel = async_compile._load_triton_kernel_from_source(kernel_name, source_code)
            kernel.precompile(warm_cache_only=True)  # triton.compile per config, no launcher
            record["configs"] = len(kernel.compile_results)
        kernels.append(record)
        return _StubKernel(kernel_name)

    return triton
