"""Shared pytest setup: skip `gpu` tests without CUDA, keep CPU threads sensible, and in the
extras lane (`make test-extras`, FSDP_FLOAT8_EXTRAS_LANE=1) fail any test that skips, and
any module that skips at collection (a module-level `pytest.importorskip` drops the whole
file before its tests exist, so no per-test hook sees it).

Tests that need an optional package (torchao, transformers, torchtitan, accelerate,
matplotlib) carry the `extras` marker and skip without it, so `make test` passes on a machine
without them; the extras lane installs them at pinned versions and runs exactly those tests,
where a skip would hide missing evidence, so there it is a failure.
"""

from __future__ import annotations

import os
from collections.abc import Generator

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


EXTRAS_LANE = os.environ.get("FSDP_FLOAT8_EXTRAS_LANE") == "1"
_LANE_REMEDY = (
    "every optional package is installed there, so a skip is missing evidence. Check the "
    "pins in .ci/extras.txt and the install step of `make test-extras`"
)


def _reason(longrepr) -> str:
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator:
    outcome = yield
    report = outcome.get_result()
    if EXTRAS_LANE and report.skipped:
        report.outcome = "failed"
        report.longrepr = (
            f"{collector.nodeid} skipped at collection in the extras lane "
            f"({_reason(report.longrepr)}); {_LANE_REMEDY}"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call) -> Generator:
    outcome = yield
    report = outcome.get_result()
    if EXTRAS_LANE and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} skipped in the extras lane ({_reason(report.longrepr)}); {_LANE_REMEDY}"
        )
