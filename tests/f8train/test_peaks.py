"""One table of GPU peaks: the trainer's MFU and the benchmarks' % of peak read the same
entry, matched by a word of the device name (L4 is not L40S, GH200 is not H200)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from f8train.bench_common import PEAK_TFLOPS, peak_tflops
from f8train.train_log import peak_flops

CUDA = torch.device("cuda")


@pytest.mark.parametrize(
    "name,key",
    [
        ("NVIDIA H200", "H200"),
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("Tesla T4", None),
    ],
)
def test_trainer_and_benchmarks_read_one_peak_table(name, key):
    with mock.patch("torch.cuda.get_device_name", return_value=name):
        peaks = peak_tflops(CUDA)
        assert peaks == (PEAK_TFLOPS[key] if key else None)
        assert peak_flops(CUDA, None) == (peaks["bf16"] * 1e12 if key else None)


def test_cpu_has_no_peak_unless_given():
    assert peak_tflops(torch.device("cpu")) is None
    assert peak_flops(torch.device("cpu"), None) is None
    assert peak_flops(torch.device("cpu"), 100.0) == 100e12
