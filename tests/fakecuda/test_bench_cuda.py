"""Fake CUDA: the CUDA branches of the benchmarks gpu_bench.sh runs (bench_linear eager, the
recipes an H200 runs; bench_cast eager): every row must come back without an error. Times
are placeholders here; the GPU measures them."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from f8train import bench_cast, bench_linear
from tests.fakecuda.fake_fsdp import fake_gpu_machine

pytestmark = pytest.mark.fakecuda


def _on_fake_h200(module):
    cuda = torch.device("cuda")
    return (
        mock.patch.object(module, "resolve_device", lambda name, threads=None: cuda),
        mock.patch.object(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200"),
    )


def test_bench_linear_cuda_rows():
    recipes = "tensorwise,rowwise,rowwise_with_gw_hp,blockwise"
    resolve, name = _on_fake_h200(bench_linear)
    with fake_gpu_machine(), resolve, name:
        out = bench_linear.main(
            ["--device", "cuda", "--shapes", "256x256x512", "--recipes", recipes,
             "--warmup", "0", "--iters", "1"]
        )  # fmt: skip
    rows = out["results"]
    assert [r["recipe"] for r in rows] == recipes.split(",")
    assert all(r["error"] is None for r in rows), [(r["recipe"], r["error"]) for r in rows]


def test_bench_cast_cuda_rows():
    resolve, name = _on_fake_h200(bench_cast)
    with fake_gpu_machine(), resolve, name:
        out = bench_cast.main(["--device", "cuda", "--sizes", "256x512", "--iters", "1"])
    rows = out["results"]
    assert len(rows) >= 1 + len(bench_cast.CASTS)
    assert all(r.get("error") is None for r in rows), [(r["case"], r["error"]) for r in rows]
