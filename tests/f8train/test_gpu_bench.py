"""f8train/gpu_bench.sh's steps add up to at most 6 minutes (their limits, kill margins
included), and its comparison of the two training runs reads partial runs: checked on CPU
(the run itself needs a GPU)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from f8train.compare import compare_runs

ROOT = Path(__file__).resolve().parents[2]
BUDGET_S = 360  # 6 minutes of step limits, kill margins included
STEP = re.compile(r"^step (\S+) +limit +(\d+) s \(\+(\d+) kill\): (.*)$")


def _dry_run() -> tuple[list[tuple[str, int, str]], str]:
    out = subprocess.run(
        ["bash", str(ROOT / "f8train" / "gpu_bench.sh"), "--dry-run"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    steps = [
        (m[1], int(m[2]) + int(m[3]), m[4])
        for m in map(STEP.match, out.splitlines())
        if m is not None
    ]
    return steps, out.splitlines()[-1]


def test_dry_run_total_fits_the_budget():
    steps, total_line = _dry_run()
    names = [name for name, _, _ in steps]
    assert len(names) == len(set(names)) >= 8, names
    total = sum(limit for _, limit, _ in steps)
    assert total_line == f"total {total} s worst case (limits plus 5 s kill margin each)"
    assert total <= BUDGET_S, f"{total} s > {BUDGET_S} s: {steps}"


def test_steps_run_what_an_h200_runs_with_the_machines_torch():
    steps, _ = _dry_run()
    commands = {name: cmd for name, _, cmd in steps}
    for name, cmd in commands.items():
        assert "mxfp8" not in cmd and "pip" not in cmd, (name, cmd)
    recipes = {
        cmd.split("--recipe ")[1].split()[0]
        for n, cmd in commands.items()
        if "train_" in n and "--recipe " in cmd
    }
    assert recipes == {"off", "tensorwise"}, recipes  # bf16 against float8, same run
    assert "--nproc_per_node 1" in commands["train_float8"]
    for name in ("linear_eager", "linear_compile", "cast", "fsdp", "train_compare"):
        assert "--json" in commands[name], name  # each writes its results under OUTDIR


def _metrics(run: Path, tokens_per_s: list[float], mem_gib: float) -> None:
    run.mkdir(parents=True)
    lines = [
        {"step": i + 1, "loss": 5.0 - i / 10, "tokens_per_s": t, "mfu": t / 1e6,
         "peak_memory_bytes": int(mem_gib * 2**30)}
        for i, t in enumerate(tokens_per_s)
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_train_compare_takes_medians_after_warmup_and_partial_runs(tmp_path):
    _metrics(tmp_path / "bf16", [10.0, 90.0, 100.0, 110.0], 40.0)
    _metrics(tmp_path / "float8", [5.0, 150.0, 160.0], 30.0)  # cut short by its timeout
    out = compare_runs(
        [str(tmp_path / "bf16"), str(tmp_path / "float8")], 1, str(tmp_path / "cmp.json")
    )
    bf16, float8 = out["runs"]
    assert (bf16["tokens_per_s"], float8["tokens_per_s"]) == (100.0, 155.0)
    assert out["ratio"]["tokens_per_s"] == 1.55 and out["ratio"]["peak_memory_gib"] == 0.75
    assert json.loads((tmp_path / "cmp.json").read_text())["ratio"] == out["ratio"]
    missing = compare_runs([str(tmp_path / "bf16"), str(tmp_path / "none")], 5)
    assert missing["runs"][1]["tokens_per_s"] is None and missing["ratio"]["mfu"] is None


def test_compare_runs_cli_imports_no_torch_and_refuses_training_flags(tmp_path):
    """The step has 5 s: `python -m f8train.compare --runs` must not import torch."""
    _metrics(tmp_path / "a", [10.0, 20.0], 1.0)
    code = (
        "import sys; from f8train import compare; "
        f"rc = compare.main(['--runs', {str(tmp_path / 'a')!r}, {str(tmp_path / 'a')!r}]); "
        "assert rc == 0 and 'torch' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
    refused = subprocess.run(
        [sys.executable, "-m", "f8train.compare", "--runs", "a", "b", "--dim", "64"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "--runs trains nothing" in refused.stderr


def test_linear_compile_prints_each_measured_time_beside_its_prediction(tmp_path, capsys):
    from f8train import gpu_predicted

    shape = "16384x4096x14336"
    measured = {"results": [
        {"shape": shape, "mode": "compile", "recipe": "tensorwise", "bf16_ms": 7.0, "float8_ms": 5.0},
        {"shape": shape, "mode": "eager", "recipe": "tensorwise", "bf16_ms": 9.0, "float8_ms": 8.0},
    ]}  # fmt: skip
    path = tmp_path / "linear_compile.json"
    path.write_text(json.dumps(measured))
    table = gpu_predicted.main([str(path)])
    predicted = json.loads(gpu_predicted.DEFAULT.read_text())["blocks"]
    want = predicted[f"{shape} fsdp_float8 tensorwise"]["roofline_s"] * 1e3
    assert [row[:3] for row in table] == [[shape, "bf16", "7.000"], [shape, "tensorwise", "5.000"]]
    assert table[1][3:] == [f"{want:.3f}", f"{5.0 / want:.2f}"]
    assert "predicted ms (h100)" in capsys.readouterr().out
    _, _, commands = zip(*_dry_run()[0])
    assert any("f8train.gpu_predicted" in c and "linear_compile.json" in c for c in commands)
