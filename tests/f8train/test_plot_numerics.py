"""The numerics heatmap script (`f8train.plot_numerics`) on a telemetry file written by
`Float8Telemetry`: the grid it builds, its exit code without matplotlib, the PNG with it."""

from __future__ import annotations

import json
import sys

import pytest

from f8train import plot_numerics
from fsdp_float8 import Float8LinearConfig
from fsdp_float8.tools.telemetry import Float8Telemetry, append_jsonl
from tests.unit.test_telemetry import _model, _train_step


@pytest.mark.extras
def test_plot_script_writes_png(tmp_path, monkeypatch):
    model = _model(Float8LinearConfig.rowwise())
    tel = Float8Telemetry(model, every=2, all_casts=True)
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n")  # a training line: skipped
    for step in range(5):
        _train_step(model, step)
        tel.step()
    assert append_jsonl(path, tel.flush()) == 3 * 2 * 3 * 2
    labels, steps, grid = plot_numerics.build_grid(plot_numerics.read_records(path), "amax")
    assert steps == [0, 2, 4] and "up.input@output" in labels and len(grid) == 12

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert plot_numerics.main([str(path), "--out", str(tmp_path / "none.png")]) == 2
    monkeypatch.undo()

    pytest.importorskip("matplotlib")
    out = tmp_path / "numerics.png"
    assert plot_numerics.main([str(path), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
