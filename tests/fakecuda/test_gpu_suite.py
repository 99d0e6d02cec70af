"""Fake CUDA: the tests of tests/gpu, run as they are on fake cuda tensors (H200), so a GPU
draw is not spent on a call a kernel refuses. Their value assertions pass vacuously here
(placeholders, `fake_cuda(truth=True)`): the GPU checks the numbers. NCCL becomes the fake
process group, a cuda Generator a CPU one, and `Tensor.backward` the Python graph walk."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.fakecuda import fake_cuda as fc
from tests.fakecuda.fake_fsdp import fake_streams
from tests.gpu import test_cuda, test_cuda_contract

pytestmark = pytest.mark.fakecuda
RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]
CASES = [
    *[(test_cuda.test_real_scaled_mm_matches_emulation_on_cuda, {"recipe": r}) for r in RECIPES],
    (test_cuda.test_batched_cuda_amax_equals_per_tensor_amax, {}),
    (test_cuda.test_fsdp_float8_all_gather_one_rank_nccl, {}),
    *[
        (
            test_cuda_contract.test_real_scaled_mm_fwd_bwd_with_odd_token_counts,
            {"recipe": r, "tokens": t, "dims": d},
        )
        for r in RECIPES
        for t in (1, 5, 33, 100)
        for d in ((256, 128), (32, 2))
    ],
    (test_cuda_contract.test_rowwise_float32_output_is_refused_on_cuda, {}),
    *[
        (test_cuda_contract.test_fsdp_one_nccl_rank_matches_unsharded, {"recipe": r, "dtype": d})
        for r, d in (("tensorwise", torch.float32), ("rowwise", torch.bfloat16))
    ],
]


# gpu tests whose last assertion compares loss values: placeholders (every .item() is 1.0)
# make "the loss went down" false, after every CUDA call of the test has run
VALUE_CHECK_LAST = {"test_fsdp_one_nccl_rank_matches_unsharded": r"assert 1\.0 < 1\.0"}


def _id(case) -> str:
    fn, kwargs = case
    return "-".join([fn.__name__, *(str(v).replace("torch.", "") for v in kwargs.values())])


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
def _fake_gpu_machine():
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


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_gpu_test_on_fake_cuda(case, tmp_path):
    fn, kwargs = case
    params = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    if "tmp_path" in params:
        kwargs = {**kwargs, "tmp_path": tmp_path}
    with _fake_gpu_machine():
        if fn.__name__ in VALUE_CHECK_LAST:  # every call ran; only its last line reads values
            with pytest.raises(AssertionError, match=VALUE_CHECK_LAST[fn.__name__]):
                fn(**kwargs)
        else:
            fn(**kwargs)
