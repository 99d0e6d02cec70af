"""The fake-CUDA lane (`make test-fakecuda`): needs the CUDA build of torch, runs on CPU.

Every module here is marked `fakecuda`, which the default suite deselects (pyproject
addopts); without a CUDA build of torch the lane skips with the command that runs it.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _needs_cuda_build():
    if torch.version.cuda is None:
        pytest.skip("needs the CUDA build of torch (CPU is enough): make test-fakecuda")
