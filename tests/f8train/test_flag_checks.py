"""Flags a run would ignore are refused at argument time, naming the flag, why it does
nothing, and the remedy (``f8train/float8_flags.py``, ``f8train/train_args.py``); so is a
binary token file that would train as text."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from f8train.data import load_tokens
from f8train.train_args import parse_args


@pytest.mark.parametrize(
    "argv, message",
    [
        (  # was dropped: the run reported tensorwise/dynamic
            ["--static-scales", "input=4"],
            "--static-scales input=4 is used only with --scaling static (this run: --scaling "
            "dynamic); add --scaling static",
        ),
        (  # was a raw ValueError traceback
            ["--scaling", "static", "--static-scales", "input=abc"],
            "--static-scales item 'input=abc': 'abc' is not a finite number > 0",
        ),
        (["--scaling", "static", "--static-scales", "weight=-2"], "'-2' is not a finite number"),
        (["--scaling", "static", "--static-scales", "wieght=2"], "expected NAME=VALUE with NAME"),
        (  # was a silent full conversion
            ["--float8-skip", "layers.0.*"],
            "--float8-skip 'layers.0.*' matches none of the 28 layers float8 could convert "
            "(e.g. blocks.0.attention.wq",
        ),
        (["--delayed-history", "4"], "--delayed-history 4 is used only with --scaling delayed"),
        (["--scaling", "static", "--no-precompute"], "--no-precompute applies to --scaling"),
        (["--token-dtype", "uint16"], "--token-dtype uint16 applies to a token file"),
        # no weight of these runs has a precomputed scale for --no-precompute to turn off
        (["--recipe", "rowwise", "--no-precompute"], "--no-precompute changes nothing with"),
        (["--recipe", "mxfp8", "--no-precompute"], "--no-precompute changes nothing with"),
        (
            ["--no-fp8-all-gather", "--no-precompute"],
            "--no-precompute changes nothing with --recipe tensorwise and --no-fp8-all-gather",
        ),
        # on CPU these recipes' GEMMs are emulated whatever --emulate says
        (["--device", "cpu", "--recipe", "mxfp8", "--emulate"], "--emulate changes nothing"),
        (["--device", "cpu", "--recipe", "nvfp4", "--emulate"], "on --device cpu"),
        # with neither --resume nor --auto-resume nothing is resumed for them to allow
        (["--no-auto-resume", "--allow-recipe-change"], "--allow-recipe-change applies"),
        (["--no-auto-resume", "--allow-batch-change"], "--allow-batch-change applies"),
        (["--recipe", "off", "--scaling", "delayed"], "--scaling has no effect with --recipe off"),
        (["--recipe", "off", "--fp8-all-gather"], "--fp8-all-gather / --no-fp8-all-gather has"),
        (["--recipe", "off", "--float8-skip", "blocks.0.*"], "--float8-skip has no effect"),
        (["--recipe", "off", "--numerics-every", "5"], "--numerics-every has no effect"),
        (["--recipe", "off", "--emulate"], "--emulate has no effect with --recipe off"),
        (["--recipe", "off", "--token-dtype", "uint32"], "--token-dtype uint32 applies to a"),
        (["--steps", "5", "--stop-at-step", "5"], "--stop-at-step 5 is not before --steps 5"),
        (["--data", __file__, "--cache-dir", "/tmp/x"], "but --data " + __file__ + " is one"),
        (
            ["--recipe", "nvfp4", "--tp", "2", "--seq-len", "32"],
            "argument --tp: --recipe nvfp4 is not supported under tensor parallelism",
        ),
        (
            ["--recipe", "nvfp4_4over6", "--tp", "2", "--seq-len", "32"],
            "argument --tp: --recipe nvfp4_4over6 is not supported under tensor parallelism",
        ),
    ],
)
def test_ignored_flags_are_refused(argv, message, capsys, tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        parse_args([*argv, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


def test_flags_that_act_are_accepted(tmp_path: Path) -> None:
    out = ["--out", str(tmp_path / "run")]
    args = parse_args(["--scaling", "static", "--static-scales", "input=4", *out])
    assert args.static_scales == "input=4"
    assert parse_args(["--scaling", "delayed", "--delayed-history", "4", *out]).delayed_history == 4
    assert parse_args(out).delayed_history == 16  # the default, resolved after the checks
    assert parse_args(["--float8-skip", "blocks.0.*", *out]).float8_skip == ["blocks.0.*"]
    assert parse_args(["--float8-skip", "*.feed_forward.w2", *out]).float8_skip
    moe = ["--recipe", "nvfp4", "--preset", "moe_tiny", "--float8-skip", "*.experts", *out]
    assert parse_args(moe).float8_skip == ["*.experts"]
    # weights whose all-gather scale (or NVFP4 tensor amax) the float8 step precomputes
    for recipe in ("tensorwise", "nvfp4"):
        assert not parse_args(["--recipe", recipe, "--no-precompute", *out]).precompute
    # on CPU tensorwise --emulate swaps torch._scaled_mm for the float32 emulation
    assert parse_args(["--device", "cpu", "--emulate", *out]).emulate
    assert parse_args(["--no-auto-resume", "--resume", "--allow-batch-change", *out])
    assert parse_args(["--allow-recipe-change", *out]).allow_recipe_change  # auto-resume
    for recipe in ("nvfp4", "nvfp4_4over6"):  # the telemetry observes NVFP4 layers too
        assert parse_args(["--recipe", recipe, "--numerics-every", "5", *out]).numerics_every == 5


def test_binary_token_file_without_suffix_is_not_trained_as_text(tmp_path: Path) -> None:
    path = tmp_path / "corpus"  # uint16 token ids, no .u16.bin suffix
    (np.arange(5000, dtype=np.uint16) % 200).tofile(path)
    with pytest.raises(ValueError, match="holds NUL bytes .* looks like a binary token file"):
        load_tokens(path, cache_dir=tmp_path)
    data = load_tokens(path, cache_dir=tmp_path, token_dtype="uint16")  # the remedy
    assert data.tokens.dtype == np.uint16 and len(data.tokens) == 5000
    text = tmp_path / "notes.txt"
    text.write_text("plain text\n" * 100)
    assert load_tokens(text, cache_dir=tmp_path).vocab_size == 256


def test_compare_passes_float8_flags_to_float8_runs_only() -> None:
    from f8train import compare

    args, extra = compare.parse_args(["--configs", "bf16,tensorwise", "--float8-skip", "*.w2"])
    assert extra == ["--float8-skip", "*.w2"]
    assert "--float8-skip" not in compare.train_command("bf16", args, extra)
    assert compare.train_command("tensorwise", args, extra)[-2:] == ["--float8-skip", "*.w2"]


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--json", "cmp.json"], "--json"),  # a --runs flag on a training comparison
        (["--skip", "3"], "--skip"),
        (["--runs", "a", "b", "--steps", "10"], "--steps"),  # a training flag with --runs
        (["--runs", "a", "b", "--configs", "bf16", "--rerun"], "--configs, --rerun"),
    ],
)
def test_compare_refuses_its_flags_that_the_mode_ignores(argv, named, capsys) -> None:
    """compare's --skip/--json act only with --runs, and --nproc/--configs/--out/--steps/
    --rerun only without it; given in the other mode they used to be ignored silently."""
    from f8train import compare

    with pytest.raises(SystemExit):
        compare.parse_args(argv)
    assert f"{named} " in capsys.readouterr().err


def test_block_all_gather_misfits_are_named_before_training(tmp_path: Path, monkeypatch) -> None:
    """--recipe mxfp8 (float8 all-gather by default) on 2 ranks with 32-row wk/wv used to
    fail at step 1 on every rank with a ValueError naming no layer and API remedies (also
    when resuming a 1-rank run on 2 ranks). Now main() stops before any process group,
    naming each layer and the flags that run."""
    import torch.distributed as dist

    from f8train import train
    from tests.f8train.launch import TINY

    out = tmp_path / "run"
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as info:
        train.main([*TINY, "--recipe", "mxfp8", "--out", str(out)])
    message = str(info.value)
    assert not dist.is_initialized()
    assert (
        "--recipe mxfp8 with float8 all-gather (on by default for this recipe) on 2 shards"
        in message
    )
    assert "whole 32-row blocks (out_features divisible by 64)" in message, message
    assert "blocks.0.attention.wk (32 rows)" in message
    assert "--no-fp8-all-gather" in message and "--float8-skip '*.attention.wv'" in message
    assert "--allow-recipe-change" not in message
    (out / "checkpoints" / "step_00000002").mkdir(parents=True)  # a 1-rank run's checkpoint
    (out / "checkpoints" / "step_00000002" / "manifest.json").write_text("{}")
    with pytest.raises(SystemExit, match="add --allow-recipe-change to resume"):
        train.main([*TINY, "--recipe", "mxfp8", "--out", str(out)])
    monkeypatch.setenv("WORLD_SIZE", "1")  # one shard takes any rows: no refusal
    args = train.parse_args([*TINY, "--recipe", "mxfp8", "--out", str(out)])
    config = train.float8_config(args)
    assert train.block_all_gather_problem(args, config, 1, resuming=False) is None


def test_default_out_is_one_folder_per_recipe(tmp_path: Path, monkeypatch) -> None:
    """The float8 run and its bf16 baseline, both with the default --out, do not share a
    folder (the second would find the first's checkpoint and refuse to resume it); an
    explicit --out is kept as given."""
    monkeypatch.chdir(tmp_path)
    assert parse_args([]).out == "runs/train-tensorwise"
    assert parse_args(["--recipe", "off"]).out == "runs/train-off"
    assert parse_args(["--recipe", "mxfp8"]).out == "runs/train-mxfp8"
    assert parse_args(["--recipe", "off", "--out", "mine"]).out == "mine"


def test_nvfp4_recipe_config(tmp_path: Path) -> None:
    from f8train.float8_flags import describe, float8_config
    from fsdp_float8 import NVFP4Config

    out = ["--out", str(tmp_path / "run")]
    args = parse_args(["--recipe", "nvfp4", *out])
    assert float8_config(args) == NVFP4Config(enable_fsdp_float8_all_gather=True)
    assert describe(args).startswith("nvfp4/dynamic fp4-all-gather")
    no_ag = parse_args(["--recipe", "nvfp4", "--no-fp8-all-gather", *out])
    assert float8_config(no_ag) == NVFP4Config()
    emulated = parse_args(["--recipe", "nvfp4", "--device", "cuda", "--emulate", *out])  # < SM100
    assert float8_config(emulated) == NVFP4Config(enable_fsdp_float8_all_gather=True, emulate=True)
    delayed = parse_args(["--recipe", "nvfp4", "--scaling", "delayed", *out])
    with pytest.raises(SystemExit, match="NVFP4 scales are dynamic"):
        float8_config(delayed)


def test_nvfp4_four_over_six_recipe_config(tmp_path: Path) -> None:
    from f8train.compare import CONFIGS, train_command
    from f8train.float8_flags import describe, float8_config
    from fsdp_float8 import NVFP4Config

    out = ["--out", str(tmp_path / "run")]
    args = parse_args(["--recipe", "nvfp4_4over6", *out])
    want = NVFP4Config(enable_fsdp_float8_all_gather=True, four_over_six=True)
    assert float8_config(args) == want
    assert describe(args).startswith("nvfp4_4over6/dynamic fp4-all-gather")
    no_ag = parse_args(["--recipe", "nvfp4_4over6", "--no-fp8-all-gather", *out])
    assert float8_config(no_ag) == NVFP4Config(four_over_six=True)
    assert float8_config(parse_args(["--recipe", "nvfp4", *out])).four_over_six is False
    delayed = parse_args(["--recipe", "nvfp4_4over6", "--scaling", "delayed", *out])
    with pytest.raises(SystemExit, match="NVFP4 scales are dynamic"):
        float8_config(delayed)
    # f8train.compare trains it by name, with the FP4 all-gather
    assert CONFIGS["nvfp4_4over6"] == ["--recipe", "nvfp4_4over6", "--fp8-all-gather"]
    command = train_command("nvfp4_4over6", argparse.Namespace(nproc=2, steps=5, out="o"), [])
    assert command[command.index("--recipe") + 1] == "nvfp4_4over6"
