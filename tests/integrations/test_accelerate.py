"""accelerate's FSDP2 path with this library: convert before building the optimizer, then
`Accelerator(mixed_precision="bf16", fsdp_plugin=FullyShardedDataParallelPlugin(
fsdp_version=2))` and `prepare`. On 2 gloo ranks, tensorwise with float8 all-gather, the
losses equal (bit for bit, every step, every rank) the same loop written by hand with
`fully_shard` and the same mixed-precision policy and autocast: accelerate adds nothing to
the numerics. This needs `data_ptr()` of a float8 weight wrapper to be its inner tensor's:
accelerate maps the optimizer's parameters to the sharded ones by `data_ptr()`, and with a
shared 0 the float8 weights were merged (losses equal at step 1, apart from step 2 on)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.f8train.launch import REPO, torchrun_command

pytestmark = pytest.mark.extras


def test_accelerate_fsdp2_bf16_losses_equal_the_loop_by_hand(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    record = tmp_path / "losses.json"
    command = [*torchrun_command(2), "-m", "tests.integrations.accelerate_loop", str(record)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "RANK"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-6000:]
    for rank in range(2):
        losses = json.loads(Path(f"{record}.rank{rank}").read_text())
        print(rank, json.dumps(losses))
        assert losses["accelerate"] == losses["by_hand"], rank
        assert len(losses["accelerate"]) == 8
        assert losses["accelerate"][-1] < losses["accelerate"][0] - 0.5  # it learns
