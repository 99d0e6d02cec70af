"""Inputs the trainer refuses before it trains, each naming the flag or file, the value and
the remedy: a binary file inside a ``--data`` folder, a ``--data`` that is not a regular
file (a named pipe would block in ``open``), a corpus too small for its validation split, a
warmup that never reaches ``--lr``, a seed torch cannot take, a model shape torch cannot
build, an empty lock file, and ``f8train.compare --runs`` on a folder that holds no run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from f8train import data as corpus
from f8train import run_control
from f8train.data import load_tokens
from f8train.train_args import build_parser, parse_args

REPO = Path(__file__).resolve().parents[2]


def _refusal(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_a_binary_file_in_a_data_folder_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("plain text\n" * 50)
    (np.arange(3000, dtype=np.uint16) % 200).tofile(folder / "sub" / "tokens")
    with pytest.raises(ValueError) as info:
        load_tokens(folder, cache_dir=tmp_path / "cache")
    message = str(info.value)
    assert f"{folder / 'sub' / 'tokens'} holds NUL bytes (the first at byte 0)" in message
    assert "--data folder" in message and "move it out of the folder" in message
    assert not list((tmp_path / "cache").glob("*.bin")), "no cache of a refused folder"
    (folder / "sub" / "tokens").unlink()
    assert load_tokens(folder, cache_dir=tmp_path / "cache").vocab_size == 256


def test_a_named_pipe_as_data_is_refused_without_opening_it(tmp_path: Path, capsys) -> None:
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)  # no writer: opening it would block for ever
    err = _refusal(["--data", str(pipe), "--out", str(tmp_path / "run")], capsys)
    assert f"argument --data: {pipe} is not a regular file or a folder (a named pipe)" in err
    with pytest.raises(ValueError, match="is not a regular file or a folder"):
        load_tokens(pipe, cache_dir=tmp_path)
    missing = tmp_path / "nothing.txt"
    err = _refusal(["--data", str(missing), "--out", str(tmp_path / "run")], capsys)
    assert f"argument --data: {missing} does not exist" in err


def test_a_corpus_too_small_for_its_validation_split_is_refused_naming_the_flags(
    tmp_path: Path, capsys
) -> None:
    small = tmp_path / "small.txt"
    small.write_bytes(b"some user text\n" * 9000)  # 135,000 bytes
    out = ["--out", str(tmp_path / "run")]
    err = _refusal(["--data", str(small), *out], capsys)
    assert f"argument --data: {small} holds 135,000 tokens" in err, err
    assert "validation split (--val-fraction 0.01) is 1,350 tokens" in err
    assert "0 batches of --global-batch 16 x (--seq-len 128 + 1) tokens" in err
    assert "--val-batches 4" in err
    need = corpus.min_corpus_tokens(val_fraction=0.01, seq_len=128, global_batch=16, val_batches=4)
    assert f"at least {need:,} tokens" in err
    # each remedy the message names works
    assert 800_000 < need < 850_000
    assert parse_args(["--data", str(small), "--val-fraction", "0.1", *out])
    assert parse_args(["--data", str(small), "--val-batches", "1", "--seq-len", "32", *out])
    data = load_tokens(small, val_fraction=0.1)
    assert len(data.val) > 4 * 16 * 128  # the check and the split agree


def test_min_corpus_tokens_is_the_boundary() -> None:
    from f8train.token_batches import ValidationBatches

    need = corpus.min_corpus_tokens(val_fraction=0.03, seq_len=8, global_batch=4, val_batches=3)
    for n, fits in ((need, True), (need - 1, False)):
        tokens = np.zeros(n, dtype=np.uint16)
        val = tokens[n - max(1, int(n * 0.03)) :]
        layout = dict(seq_len=8, global_batch=4, num_batches=3)
        if fits:
            assert len(ValidationBatches(val, **layout)) == 3
        else:
            with pytest.raises(ValueError, match="holds 2 batches"):
                ValidationBatches(val, **layout)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--warmup", "50", "--steps", "3"],
            "argument --warmup: --warmup 50 is not below --steps 3, so the learning rate never "
            "reaches --lr 0.003; use a --warmup below --steps",
        ),
        (
            ["--seed", str(2**70)],
            f"argument --seed: expected an integer >= 0 and <= {2**64 - 1}, got '{2**70}'",
        ),
        (
            ["--dim", "65"],
            "argument --dim: ModelArgs dim=65, n_heads=4 give head_dim 16.25",
        ),
    ],
)
def test_flags_out_of_their_range_are_refused(argv, message, capsys, tmp_path: Path) -> None:
    err = _refusal([*argv, "--out", str(tmp_path / "run")], capsys)
    assert message in err, err
    assert "--data:" not in err


def test_flags_at_their_limit_are_accepted(tmp_path: Path) -> None:
    out = ["--out", str(tmp_path / "run")]
    assert parse_args(["--warmup", "2", "--steps", "3", *out]).warmup == 2
    assert parse_args(["--seed", str(2**64 - 1), *out]).seed == 2**64 - 1


def test_an_empty_lock_says_so_and_how_to_clear_it(tmp_path: Path) -> None:
    lock = tmp_path / run_control.LOCK
    for content in ("", "{not json", '{"host": "h"}'):
        lock.write_text(content)
        why = run_control.acquire_lock(tmp_path)
        assert why is not None
        assert f"the lock file {lock} is empty or unreadable" in why, why
        assert "pid None" not in why and "1970" not in why
        assert f"delete {lock} and rerun" in why
        assert lock.read_text() == content  # not taken over: a job may be writing it


@pytest.mark.parametrize(
    "owner",
    [
        {"host": "h", "pid": 1, "started": "yesterday"},
        {"host": "h", "pid": "one", "started": 0},
        {"host": ["h"], "pid": 1, "started": 0},
        {"host": "h", "pid": 1, "started": float("inf")},
        ["host", "pid", "started"],
    ],
)
def test_a_lock_of_the_wrong_shape_is_named_not_a_crash(owner, tmp_path: Path) -> None:
    lock = tmp_path / run_control.LOCK
    content = json.dumps(owner)
    lock.write_text(content)
    why = run_control.acquire_lock(tmp_path)
    assert why is not None and f"the lock file {lock} is empty or unreadable" in why, why
    assert "a string host, an integer pid and a number started" in why, why
    assert f"delete {lock} and rerun" in why
    assert lock.read_text() == content  # not taken over


def test_compare_runs_on_a_missing_folder_is_an_error_naming_it(tmp_path: Path) -> None:
    good = tmp_path / "good"
    good.mkdir()
    (good / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "tokens_per_s": 5.0}\n')
    empty = tmp_path / "empty"
    empty.mkdir()
    for bad, why in ((tmp_path / "missing", "no such folder"), (empty, "no metrics.jsonl")):
        result = subprocess.run(
            [sys.executable, "-m", "f8train.compare", "--runs", str(good), str(bad)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2, result
        assert f"--runs {bad}: {why}" in result.stderr, result.stderr
        assert "| -" not in result.stdout


def test_trainer_doc_states_the_smallest_corpus_the_checks_accept() -> None:
    """docs/trainer.md's minimum corpus sizes are the ones the argument check computes."""
    text = " ".join((REPO / "docs" / "trainer.md").read_text().split())
    d = build_parser().parse_args([])
    shape = dict(seq_len=d.seq_len, global_batch=d.global_batch)
    at_defaults = corpus.min_corpus_tokens(
        val_fraction=d.val_fraction, val_batches=d.val_batches, **shape
    )
    small = corpus.min_corpus_tokens(val_fraction=0.1, val_batches=1, **shape)
    assert f"a corpus needs {at_defaults:,} tokens" in text
    assert f"`--val-fraction 0.1 --val-batches 1`, {small:,})" in text
