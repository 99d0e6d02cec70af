"""f8train.gpu_codegen patches torch 2.11 internals: on any other torch (the default suite's
2.13 CPU build) it refuses with a message naming the versions and the lane to run."""

from __future__ import annotations

import pytest
import torch

from f8train import gpu_codegen


@pytest.mark.skipif(
    torch.__version__.startswith(gpu_codegen.TORCH_VERSION) and torch.version.cuda is not None,
    reason="the CUDA build of torch 2.11 is the one gpu_codegen runs on",
)
def test_refuses_another_torch_with_a_clear_message():
    with pytest.raises(RuntimeError, match=r"torch 2\.11\.x \(CUDA build\).*make test-gpucodegen"):
        with gpu_codegen.gpu_codegen("h100"):
            pass
