"""The trainer's early refusals, in-process: numeric flags, an unwritable ``--out``, token
ids beyond the vocabulary, settings that differ from the checkpoint's, and a collective
timeout's message. Each names the flag or file, the observed value and the remedy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from f8train.process_group import collective_failure_message
from f8train.resume import checkpoint_settings, refusal, resume_conflicts
from f8train.train import load_data
from f8train.train_args import parse_args


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--warmup", "-5"], "argument --warmup: expected an integer >= 0, got '-5'"),
        (["--steps", "0"], "argument --steps: expected an integer >= 1, got '0'"),
        (["--lr", "0"], "argument --lr: expected a number > 0, got '0'"),
        (["--lr", "nan"], "argument --lr: expected a number > 0, got 'nan'"),
        (["--min-lr-ratio", "1.5"], "argument --min-lr-ratio: expected a number >= 0 and <= 1"),
        (
            ["--seed", "-1"],
            f"argument --seed: expected an integer >= 0 and <= {2**64 - 1}, got '-1'",
        ),
        (["--delayed-history", "0"], "argument --delayed-history: expected an integer >= 1"),
        (["--pg-timeout-s", "-3"], "argument --pg-timeout-s: expected a number > 0, got '-3'"),
        (["--val-fraction", "1"], "argument --val-fraction: expected a number in (0, 1), got '1'"),
        (["--grad-clip", "x"], "argument --grad-clip: expected a number >= 0, got 'x'"),
    ],
)
def test_numeric_flags_are_validated(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_unwritable_out_is_refused_at_argument_time(tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for out, problem in [
        (blocker, f"{blocker} is a file, not a folder"),
        (blocker / "run", f"{blocker} is a file, so {blocker / 'run'} cannot be created"),
    ]:
        with pytest.raises(SystemExit):
            parse_args(["--out", str(out)])
        assert f"argument --out: {problem}" in capsys.readouterr().err
    assert parse_args(["--out", str(tmp_path / "new" / "run")]).out  # creatable: accepted


def test_token_ids_beyond_the_vocabulary_are_refused_when_loading(tmp_path: Path) -> None:
    path = tmp_path / "corpus.u16.bin"
    tokens = np.arange(4000, dtype=np.uint16) % 250
    tokens[3000] = 300  # the tiny preset's vocabulary is 256
    tokens.tofile(path)
    small = ["--val-fraction", "0.25", "--global-batch", "2", "--seq-len", "16"]
    with pytest.raises(SystemExit) as err:
        load_data(parse_args(["--data", str(path), *small, "--out", str(tmp_path / "run")]))
    message = str(err.value)
    assert f"tokens {path}: token id 300 is outside the model's vocabulary of 256" in message
    assert "ids 0..255" in message and "at token 3,000" in message and "--preset" in message
    tokens[3000] = 255
    tokens.tofile(path)
    assert load_data(parse_args(["--data", str(path), *small])).vocab_size is None  # in range: fine


def _settings(*argv: str) -> dict:
    return checkpoint_settings(parse_args(list(argv)))


@pytest.mark.parametrize(
    "old, new, allow, expected",
    [
        (
            (),
            ("--scaling", "delayed"),
            False,
            [
                "--delayed-history: checkpoint -, this run 16",
                "--scaling: checkpoint dynamic, this run delayed",
            ],
        ),
        (
            ("--scaling", "delayed"),
            ("--scaling", "delayed", "--delayed-history", "4"),
            False,
            ["--delayed-history: checkpoint 16, this run 4"],
        ),
        (
            (),
            ("--no-fp8-all-gather",),
            False,
            ["--fp8-all-gather / --no-fp8-all-gather: checkpoint on, this run off"],
        ),
        (
            (),
            ("--recipe", "rowwise"),
            False,
            [
                "--fp8-all-gather / --no-fp8-all-gather: checkpoint on, this run off",
                "--recipe: checkpoint tensorwise, this run rowwise",
            ],
        ),
        ((), ("--recipe", "rowwise"), True, []),
        (("--recipe", "off"), (), True, []),  # bf16 warm start, then float8
        (
            (),
            ("--scaling", "delayed"),
            True,
            [
                "--delayed-history: checkpoint -, this run 16",
                "--scaling: checkpoint dynamic, this run delayed",
            ],
        ),
        ((), ("--dim", "128"), True, ["--dim (or --preset): checkpoint 256, this run 128"]),
        ((), ("--steps", "500", "--lr", "1e-3", "--compile"), False, []),  # free to change
    ],
)
def test_resume_conflicts_name_each_setting(old, new, allow, expected) -> None:
    assert resume_conflicts(_settings(*old), _settings(*new), allow_recipe_change=allow) == expected


def test_refusal_says_what_to_do() -> None:
    lines = resume_conflicts(
        _settings(), _settings("--recipe", "rowwise"), allow_recipe_change=False
    )
    text = refusal("out/checkpoints/step_00000004", lines, "out/run.json", False)
    assert text.startswith("cannot resume from out/checkpoints/step_00000004")
    assert "  --recipe: checkpoint tensorwise, this run rowwise" in text
    assert "out/run.json" in text and "another --out" in text and "--allow-recipe-change" in text


def test_collective_failure_messages_name_the_flag_or_the_peer() -> None:
    err = RuntimeError("[gloo/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation")
    text = collective_failure_message(err, 1, 3.0)
    assert text.startswith("rank 1: a collective did not complete within --pg-timeout-s 3 s")
    assert "Timed out waiting 3000ms" in text and "raise --pg-timeout-s" in text
    err = RuntimeError("[gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:11170. GLHF")
    text = collective_failure_message(err, 0, 3.0)
    assert text.startswith("rank 0: a collective failed because another rank closed its")
    assert collective_failure_message(RuntimeError("size mismatch"), 0, 3.0) is None


def test_a_batch_the_ranks_cannot_split_names_the_way_to_resume(monkeypatch, tmp_path) -> None:
    # a 2-rank run (--global-batch 16) resumed on 3 ranks: stopped before any process group,
    # with the batches that split and the flag that accepts the change
    from f8train.train import main

    out = tmp_path / "run"
    (out / "checkpoints" / "step_00000004").mkdir(parents=True)
    (out / "checkpoints" / "step_00000004" / "manifest.json").write_text("{}")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit) as stop:
        main(["--global-batch", "16", "--out", str(out), "--device", "cpu"])
    text = str(stop.value)
    assert "--global-batch 16 is not divisible by the 3 data-parallel ranks" in text, text
    assert "e.g. 15 or 18" in text and "add --allow-batch-change to resume" in text


def test_another_global_batch_is_accepted_on_resume_with_the_flag() -> None:
    from f8train.token_batches import TokenBatcher

    old, new = _settings("--global-batch", "16"), _settings("--global-batch", "15")
    lines = resume_conflicts(old, new, allow_recipe_change=False)
    assert lines == ["--global-batch: checkpoint 16, this run 15"]
    assert "--allow-batch-change accepts another --global-batch" in refusal("c", lines, "r", False)
    assert resume_conflicts(old, new, allow_recipe_change=False, allow_batch_change=True) == []
    assert parse_args(["--allow-batch-change"]).allow_batch_change
    tokens = np.arange(10_000, dtype=np.uint16)
    saved = TokenBatcher(tokens, seq_len=8, global_batch=16, world_size=2).state_dict()
    saved["step"] = 4
    resumed = TokenBatcher(tokens, seq_len=8, global_batch=15, world_size=3, batch_change=True)
    resumed.load_state_dict(saved)  # continues at step 4, 5 rows per rank
    assert resumed.step == 4 and next(resumed)[0].shape == (5, 8)
    with pytest.raises(ValueError, match="global_batch=16"):
        TokenBatcher(tokens, seq_len=8, global_batch=15, world_size=3).load_state_dict(saved)
