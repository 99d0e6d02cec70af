"""In-process checks of the training script's pieces: flags and float8 config, LR schedule,
checkpoint discovery, metrics file, summary, compare.py's table (no processes launched)."""

from __future__ import annotations

import builtins
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from f8train import compare
from f8train.checkpoint import MANIFEST, Checkpointer
from f8train.float8_flags import float8_config, parse_static_scales
from f8train.sharded_model import WarmupCosine
from f8train.train import describe
from f8train.train_args import parse_args
from f8train.train_log import MetricsFile, format_summary, read_metrics, summary
from fsdp_float8 import Float8LinearConfig, ScalingType


def test_defaults_are_the_make_train_run() -> None:
    args = parse_args([])
    config = float8_config(args)
    assert args.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert args.preset == "tiny" and args.recipe == "tensorwise" and args.precompute
    assert config.enable_fsdp_float8_all_gather
    assert describe(args).startswith(
        "tensorwise/dynamic fp8-all-gather precompute bf16 reduce-fp32"
    )


def test_rowwise_float8_all_gather_is_explicit() -> None:
    config = float8_config(parse_args(["--recipe", "rowwise"]))  # default: no fp8 all-gather
    assert not config.enable_fsdp_float8_all_gather
    config = float8_config(parse_args(["--recipe", "rowwise", "--fp8-all-gather"]))
    rowwise = Float8LinearConfig.from_recipe_name("rowwise")
    assert config == replace(rowwise, enable_fsdp_float8_all_gather=True)


def test_scaling_flags() -> None:
    assert float8_config(parse_args(["--recipe", "off"])) is None
    delayed = float8_config(parse_args(["--scaling", "delayed", "--delayed-history", "4"]))
    assert delayed.scaling_types() == {ScalingType.DELAYED}
    assert delayed.delayed_scaling_config.history_len == 4
    static = float8_config(parse_args(["--scaling", "static", "--static-scales", "input=8"]))
    assert static.cast_config_input.static_scale == 8.0
    assert static.cast_config_weight.static_scale == 2048.0
    with pytest.raises(SystemExit, match="tensorwise only"):
        float8_config(parse_args(["--recipe", "rowwise", "--scaling", "delayed"]))
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_static_scales("bias=3")


def test_warmup_cosine() -> None:
    f = WarmupCosine(warmup=10, total=110, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(60) == pytest.approx(0.55)
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)


def test_checkpointer_finds_complete_checkpoints_only(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep=2, is_main=True)
    assert ckpt.latest() is None
    for step in (5, 10, 15):
        ckpt.path_for(step).mkdir()
        (ckpt.path_for(step) / MANIFEST).touch()
    ckpt.path_for(20).mkdir()  # an interrupted save: no manifest
    (ckpt.path_for(20) / ".metadata").touch()  # DCP finished, the manifest was not written
    (tmp_path / "step_00000025.damaged").mkdir()  # set aside by a fallback: not a checkpoint
    (tmp_path / "step_00000025.damaged" / MANIFEST).touch()
    assert ckpt.latest() == ckpt.path_for(15)
    ckpt._prune()
    assert [p.name for p in ckpt.complete()] == ["step_00000010", "step_00000015"]
    assert ckpt.path_for(20).exists()  # newer than the newest complete one: left alone
    assert (tmp_path / "step_00000025.damaged").exists()  # never pruned


def test_metrics_file_drops_lines_after_the_resumed_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 7)))
    metrics = MetricsFile(path, enabled=True, resume_step=4)
    metrics.write({"step": 5, "loss": 0.5})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5]
    MetricsFile(path, enabled=True, resume_step=0)  # a fresh run starts an empty file
    assert read_metrics(path) == []


def _record(step: int, loss: float, **extra) -> dict:
    return {
        "step": step,
        "loss": loss,
        "tokens_per_s": 100.0 * step,
        "step_time_s": 1.0,
        "all_gather_bytes": 1024,
        "reduce_scatter_bytes": 2048,
        "peak_memory_bytes": 10 * step,
        "mfu": None,
        **extra,
    }


def test_summary_and_table() -> None:
    records = [_record(s, 5.0 - s) for s in range(1, 5)]
    records[-1]["val_loss"] = 1.5
    s = summary(records, {"config": "x", "train_time_s": 4.0})
    assert s["final_loss"] == 1.0 and s["val_loss"] == 1.5 and s["val_step"] == 4
    assert s["tokens_per_s"] == pytest.approx(350.0)  # steps 1-2 left out of the speed
    assert s["peak_memory_bytes"] == 40 and s["all_gather_bytes_per_step"] == 1024
    text = format_summary(s)
    assert "1.0000 / 2.5000" in text and "1.0 KiB" in text and "0:00:04" in text


def test_compare_table_and_missing_matplotlib(tmp_path: Path, monkeypatch, capsys) -> None:
    def result(name: str, val: float) -> dict:
        s = summary([_record(1, 2.0, val_loss=val)], {})
        return {"name": name, "summary": s, "metrics": [_record(1, 2.0, val_loss=val)]}

    table = compare.markdown_table([result("bf16", 2.0), result("tensorwise", 2.02)])
    assert "| tensorwise | 2.0000 | 2.0200 | +1.00% |" in table
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert not compare.plot([result("bf16", 2.0)], tmp_path / "x.png")
    assert "matplotlib is not installed" in capsys.readouterr().out


def test_compare_forwards_unknown_flags_to_train() -> None:
    args, rest = compare.parse_args(["--steps", "5", "--configs", "bf16,delayed", "--dim", "64"])
    command = compare.train_command("delayed", args, rest)
    assert command[-2:] == ["--dim", "64"] and "delayed" in command and "5" in command
    with pytest.raises(SystemExit):
        compare.parse_args(["--configs", "nope"])
