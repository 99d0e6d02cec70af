"""`--tp` refuses, at argument time, what tensor parallelism cannot run (f8train/train_args)."""

from __future__ import annotations

import pytest

from f8train.train_args import parse_args


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tp", "2", "--seq-len", "33"], "--seq-len 33 is not a multiple of --tp 2"),
        (["--tp", "2", "--scaling", "delayed"], "delayed scaling is not supported"),
        (["--tp", "2", "--recipe", "mxfp8"], "--recipe mxfp8 (block scales) is not supported"),
        (["--tp", "2", "--recipe", "blockwise"], "--recipe blockwise (block scales)"),
        (["--tp", "2", "--compile"], "--compile with --tp is not supported"),
        (["--tp", "2", "--preset", "moe_tiny"], "mixture-of-experts blocks"),
    ],
)
def test_tp_flag_combinations_are_refused(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    err = capsys.readouterr().err
    assert "argument --tp:" in err and message in err


def test_tp_accepts_the_supported_recipes() -> None:
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp", "off"):
        assert parse_args(["--tp", "2", "--recipe", recipe]).tp == 2
    assert parse_args(["--tp", "2", "--scaling", "static"]).tp == 2
