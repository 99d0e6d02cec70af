"""Shared pytest setup: skip `gpu` tests without CUDA, keep CPU threads sensible."""

from __future__ import annotations

import os

import pytest
import torch

# Intra-op threads for single-process tests: a few, never more than the machine has.
# (Distributed tests set 1 thread per rank in tests/distributed/launcher.py.)
torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
