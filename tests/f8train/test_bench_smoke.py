"""Smoke tests of the benchmark scripts: each runs as a real process with --quick sizes and
its JSON is checked for the expected fields and sane values.

bench_fsdp runs under the real `torchrun --standalone --nproc_per_node 2` (gloo); the
torchao comparison is left out (a dev-only extra that may not be installed).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_float8.core.numerics import SQNR_DB

ROOT = Path(__file__).resolve().parents[2]
OURS = ("bf16", "float8_bf16_ag", "float8_ag", "float8_ag_precompute", "delayed")


def _run(args: list[str], json_path: Path, timeout: float = 120) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [*args, "--json", str(json_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    payload = json.loads(json_path.read_text())
    assert payload["environment"]["torch"] and payload["environment"]["date"]
    assert payload["results"], "no result rows"
    return payload


def test_bench_linear_quick(tmp_path):
    payload = _run(
        [sys.executable, "-m", "f8train.bench_linear", "--quick", "--kernels"], tmp_path / "l.json"
    )
    rows = payload["results"]
    assert payload["benchmark"] == "linear"
    assert {r["recipe"] for r in rows} == {
        "tensorwise",
        "rowwise",
        "rowwise_with_gw_hp",
        "blockwise",
        "mxfp8",
    }
    for r in rows:
        assert r["error"] is None, r
        assert r["bf16_ms"] > 0 and r["float8_ms"] > 0
        assert r["speedup"] == pytest.approx(r["bf16_ms"] / r["float8_ms"])
        assert r["float8_tflops"] == pytest.approx(
            6 * r["M"] * r["K"] * r["N"] / r["float8_ms"] / 1e9
        )
        assert r["output_sqnr_db"] >= SQNR_DB["linear_output"], r
        # --kernels: the profiled step splits into GEMM time (the 3 GEMMs of the layer,
        # found under their aten names on the CPU) and the rest
        for split in (r["bf16_split"], r["float8_split"]):
            assert split["gemm_ms"] > 0 and split["other_ms"] >= 0, split
            assert 0 < split["gemm_share"] <= 1


def test_bench_cast_quick_compiled(tmp_path):
    payload = _run(
        [sys.executable, "-m", "f8train.bench_cast", "--quick", "--compile"]
        + ["--cases", "tensorwise,rowwise,amax"],
        tmp_path / "c.json",
        # inductor compiles 6 graphs: 119 s alone on torch 2.15 here, so 120 s was no margin;
        # stay under pytest's 300 s per-test ceiling
        timeout=280,
    )
    rows = {(r["case"], r["mode"]): r for r in payload["results"]}
    assert set(rows) == {
        ("copy", "eager"),
        *((c, m) for c in ("tensorwise", "rowwise", "amax") for m in ("eager", "compile")),
    }
    assert rows[("copy", "eager")]["ratio_vs_copy"] == pytest.approx(1.0)
    for key, r in rows.items():
        assert r["error"] is None, r
        assert r["median_ms"] > 0 and r["gbps"] > 0 and r["ratio_vs_copy"] > 0
        assert r["cpu_ratio_vs_copy"] > 0
        if key[1] == "compile":
            assert r["bit_equal_to_eager"] is True, "compiled cast differs from eager"
        per_element = {"copy": 4, "amax": 2}.get(key[0], 3)
        assert r["bytes"] == per_element * math.prod(r["shape"])


def test_bench_fsdp_quick_torchrun(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = (
        [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    )
    payload = _run(
        [*launcher, "--standalone", "--nproc_per_node", "2", "-m", "f8train.bench_fsdp"]
        + ["--quick", "--configs", ",".join(OURS)],
        tmp_path / "f.json",
        timeout=180,
    )
    assert payload["environment"]["world_size"] == 2
    res = {r["config"]: r for r in payload["results"]}
    assert list(res) == list(OURS)
    for r in res.values():
        assert r["error"] is None, r
        assert r["step_ms_median"] > 0 and math.isfinite(r["final_loss"])
    bf16 = res["bf16"]
    # the shape model of the other parameters' bytes holds: bf16 weights are 2 bytes each
    assert bf16["converted_ag_bytes_per_elem"] == pytest.approx(2.0)
    assert (
        res["float8_bf16_ag"]["per_step"]["all_gather_bytes"]
        == bf16["per_step"]["all_gather_bytes"]
    )
    for name in ("float8_ag", "float8_ag_precompute", "delayed"):
        r = res[name]
        assert r["per_step"]["all_gather_bytes"] < bf16["per_step"]["all_gather_bytes"]
        assert r["converted_ag_ratio_vs_bf16_bytes"] <= 0.51
    for r in res.values():  # gradients reduce in fp32 whatever the float8 setup
        assert r["per_step"]["reduce_scatter_bytes"] == bf16["per_step"]["reduce_scatter_bytes"]
        assert abs(r["final_loss"] - bf16["final_loss"]) < 0.1
        # float8 adds no host reads (each would be a sync on a GPU) to the optimizer's own
        assert r["host_reads_per_step"] == bf16["host_reads_per_step"]

    def scale_ars(name: str, phase: str) -> int:
        return res[name][phase]["scale_all_reduces"]

    assert scale_ars("bf16", "per_step") == 0
    assert scale_ars("float8_bf16_ag", "per_step") == 0
    # the float8 step: one all-reduce per step, after each optimizer.step(), none per
    # weight; the first step also has the first scales before its forward (the ranks'
    # configs are compared through the store: no all_gather of its own)
    assert [scale_ars("float8_ag_precompute", p) for p in ("init", "first_step", "per_step")] == [
        0,
        2,
        1,
    ]
    first = res["float8_ag_precompute"]["first_step"]["all_gather_count"]
    assert first == res["bf16"]["first_step"]["all_gather_count"]
    assert scale_ars("delayed", "per_step") == 1
    # without precompute each weight all-reduces its scale at every all-gather
    assert scale_ars("float8_ag", "per_step") > 1
    assert res["float8_ag_precompute"]["per_step"]["all_reduce_count"] == 1


def test_profile_census_counts_the_three_gemms_of_a_linear() -> None:
    """bench_linear --profile sorts one forward + backward's ops by kind: a linear layer runs
    three GEMMs (output, grad_input, grad_weight) in every recipe. It used to count 0 on the
    CPU, where the float8 GEMM is this library's own op (`fsdp_float8::cpu_scaled_mm`)."""
    from f8train import bench_linear

    shape = bench_linear.PRESETS["quick"][0]
    report = bench_linear.profile_recipes(shape, ["tensorwise", "rowwise"], torch.device("cpu"))
    gemms = {recipe: r["kinds"].get("GEMMs", 0) for recipe, r in report.items()}
    assert gemms == {"tensorwise": 3, "rowwise": 3}
