"""Fake CUDA: the tests of tests/gpu, run as they are on fake cuda tensors (H200), so a GPU
draw is not spent on a call a kernel refuses. Their value assertions pass vacuously here
(placeholders, `fake_cuda(truth=True)`): the GPU checks the numbers. NCCL becomes the fake
process group, a cuda Generator a CPU one, and `Tensor.backward` the Python graph walk."""

from __future__ import annotations

import pytest
import torch

from tests.fakecuda.fake_fsdp import fake_gpu_machine
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
    *[
        (test_cuda_contract.test_rowwise_float32_layer_runs_in_float32, {"recipe": r})
        for r in ("rowwise", "rowwise_with_gw_hp")
    ],
    *[
        (test_cuda_contract.test_fsdp_one_nccl_rank_matches_unsharded, {"recipe": r, "dtype": d})
        for r, d in (("tensorwise", torch.float32), ("rowwise", torch.bfloat16))
        + (("rowwise", torch.float32),)
    ],
]


# gpu tests whose last assertion compares loss values: placeholders (every .item() is 1.0)
# make "the loss went down" false, after every CUDA call of the test has run
VALUE_CHECK_LAST = {"test_fsdp_one_nccl_rank_matches_unsharded": r"assert 1\.0 < 1\.0"}


def _id(case) -> str:
    fn, kwargs = case
    return "-".join([fn.__name__, *(str(v).replace("torch.", "") for v in kwargs.values())])


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_gpu_test_on_fake_cuda(case, tmp_path):
    fn, kwargs = case
    params = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    if "tmp_path" in params:
        kwargs = {**kwargs, "tmp_path": tmp_path}
    with fake_gpu_machine():
        if fn.__name__ in VALUE_CHECK_LAST:  # every call ran; only its last line reads values
            with pytest.raises(AssertionError, match=VALUE_CHECK_LAST[fn.__name__]):
                fn(**kwargs)
        else:
            fn(**kwargs)
