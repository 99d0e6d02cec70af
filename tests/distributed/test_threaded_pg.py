"""FSDP2 + float8 under torch's multi-threaded test process group (ranks as threads of one
process): the rank handshake counts per rank, so thread-ranks meet at the same store keys
and train as a process-local model does (tensorwise, the same batch on both ranks: the
averaged gradient is each rank's own, so the losses are equal bit for bit); a deferred
check one rank queued is read by that rank only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fsdp2_float8_trains_on_thread_ranks():
    proc = subprocess.run(
        [sys.executable, "-m", "tests.distributed.threaded_pg_case"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,  # about 5 s when it works; the old per-process counter waited 300 s
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["0"] == out["1"] == out["reference"], out
    # module-level state keyed by rank: rank 1's deferred check is rank 1's to raise
    assert (out["pending 0"], out["pending 1"]) == ("nothing", "raised"), out
