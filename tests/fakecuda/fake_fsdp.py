"""FSDP2 on fake cuda: a fake process group and do-nothing CUDA streams.

Mental model: PyTorch's own FSDP2 tracing tests run FSDP2 on `FakeStore` with backend
"fake": every collective returns at once without moving data, so one process plays rank r
of a world of any size, and the all-gather / reduce-scatter buffers FSDP2 builds (shapes,
dtypes, the float8 weight wrappers' hooks) are those of that rank. The device mesh is
built outside fake mode. FSDP2 asks CUDA for the current device and makes streams and
events for its copy-in and reduce-scatter; here those are stand-ins that order nothing
(stream ordering is what tests/gpu runs under the CUDA sanitizer on a real GPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.fakecuda import fake_cuda as fc


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end) -> float:
        return 1.0


class _Stream(_Event):
    def __init__(self, *args, priority: int = 0, **kwargs):
        self.device = torch.device("cuda", 0)
        self.priority = priority

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _Event()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


@contextlib.contextmanager
def fake_streams() -> Iterator[None]:
    """CUDA device, stream and event calls answered without a driver."""
    default = _Stream()
    patches = {
        "current_device": lambda: 0,
        "device_count": lambda: 8,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "Stream": _Stream,
        "Event": _Event,
        "current_stream": lambda device=None: default,
        "default_stream": lambda device=None: default,
        "stream": lambda stream: contextlib.nullcontext(),
    }
    with contextlib.ExitStack() as stack:
        for name, value in patches.items():
            stack.enter_context(mock.patch.object(torch.cuda, name, value))
        accelerator = {
            "current_stream": lambda device=None: default,
            "synchronize": lambda device=None: None,
        }
        for name, value in accelerator.items():
            stack.enter_context(mock.patch.object(torch.accelerator, name, value))
        stack.enter_context(mock.patch.object(torch.Tensor, "record_stream", lambda t, s: None))
        yield


@contextlib.contextmanager
def fake_world(shape: tuple[int, ...], names: tuple[str, ...] | None = None, rank: int = 1):
    """A fake process group of prod(shape) ranks, this process rank `rank`; yields the
    cuda mesh (built before any fake mode, as it must be). The float8 step's host reads
    queued in it (fake flags, which have no value) go with it."""
    from fsdp_float8.fsdp import refresh

    world = 1
    for size in shape:
        world *= size
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with fake_streams():
            mesh: DeviceMesh = init_device_mesh("cuda", shape, mesh_dim_names=names)
            yield mesh
    finally:
        refresh._pending_checks.clear()
        dist.destroy_process_group()


_INIT_PROCESS_GROUP = dist.init_process_group


def _fake_init_process_group(backend=None, *, store=None, rank=0, world_size=1, **kwargs):
    _INIT_PROCESS_GROUP("fake", store=FakeStore(), rank=rank, world_size=world_size)


_SWAP = torch.utils.swap_tensors


def _swap_or_set_data(t1: torch.Tensor, t2: torch.Tensor) -> None:
    try:
        _SWAP(t1, t2)
    except RuntimeError:  # "Cannot swap t1 because it has weakref associated with it"
        t1.data = t2.data


def _mesh_outside_fake_mode(init_device_mesh):
    def build(*args, **kwargs):
        with unset_fake_temporarily(), torch.device("cpu"):
            return init_device_mesh(*args, **kwargs)

    return build


@contextlib.contextmanager
def fake_gpu_machine():
    """A whole fake GPU machine for code written for a real one: fake cuda (H200, value
    reads True), streams, NCCL as the fake process group, cuda Generators on CPU, modules
    built on cuda, meshes built outside fake mode, `Tensor.backward` as the Python walk."""
    generator = torch.Generator

    def cpu_generator(device=None):
        return generator()

    with contextlib.ExitStack() as stack:
        stack.enter_context(fake_streams())
        stack.enter_context(mock.patch.object(dist, "init_process_group", _fake_init_process_group))
        stack.enter_context(mock.patch.object(torch, "Generator", cpu_generator))
        stack.enter_context(fc.fake_cuda(fc.H200, truth=True))
        # modules built on cuda: moving a real module to fake cuda cannot swap its tensors
        stack.enter_context(torch.device("cuda"))
        # Module.to swaps a fake parameter's tensors, which fake mode's weakrefs refuse
        stack.enter_context(mock.patch.object(torch.utils, "swap_tensors", _swap_or_set_data))
        mesh_mod = torch.distributed.device_mesh
        build = _mesh_outside_fake_mode(mesh_mod.init_device_mesh)
        stack.enter_context(mock.patch.object(mesh_mod, "init_device_mesh", build))
        stack.enter_context(
            mock.patch.object(torch.Tensor, "backward", lambda t, g=None, **kw: fc.backward(t, g))
        )
        yield
