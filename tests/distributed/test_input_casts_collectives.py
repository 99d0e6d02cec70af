"""In-place collectives into an activation between two float8 linears that read it.

`dist.all_reduce(x)` and `dist.broadcast(x, 0)` write x without moving its version counter:
on 2 gloo ranks (each with its own x), the layer after the collective must give the output
it gives on a fresh copy of the reduced x, bit for bit (by default readers share no cast).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_float8 import Float8Linear, Float8LinearConfig
from tests.distributed.launcher import run_distributed

COLLECTIVES = {
    "all_reduce": lambda x: dist.all_reduce(x),
    "broadcast": lambda x: dist.broadcast(x, 0),
}


def _readers(rank: int, world_size: int) -> dict[str, bool]:
    config = Float8LinearConfig.from_recipe_name("tensorwise")
    torch.manual_seed(0)
    wq, wk = (Float8Linear(64, 32, bias=False, config=config) for _ in range(2))
    results = {}
    for name, collective in COLLECTIVES.items():
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
        q = wq(x)
        collective(x)
        results[name] = q.requires_grad and torch.equal(wk(x), wk(x.clone()))
    return results


def test_a_collective_into_the_input_between_readers_is_seen(tmp_path):
    for results in run_distributed(_readers, 2, tmp_path, timeout_s=60):
        assert all(results.values()), results
