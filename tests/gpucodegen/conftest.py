"""The GPU-codegen lane (`make test-gpucodegen`): Inductor's GPU code for an H100 and a
B200, generated and built to cubin on a CPU with the CUDA build of torch 2.11
(f8train/gpu_codegen.py); nothing runs on a GPU.

Every module here is marked `gpucodegen`, which the default suite deselects (pyproject
addopts); on another torch the lane skips with the command that runs it.
"""

from __future__ import annotations

import pytest
import torch

from f8train.gpu_codegen import TORCH_VERSION


@pytest.fixture(autouse=True)
def _needs_torch_211_cuda_build():
    if torch.version.cuda is None or not torch.__version__.startswith(TORCH_VERSION):
        pytest.skip(f"needs the CUDA build of torch {TORCH_VERSION}x: make test-gpucodegen")
