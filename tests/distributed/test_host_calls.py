"""The library's host work per training step, counted: Python calls into `fsdp_float8`.

Setting (`host_calls.py`): 2 gloo ranks, 2 blocks of 2 bias-free linears (64 -> 128 -> 64),
each block and the root `fully_shard`ed, float8 (NVFP4) all-gather on, AdamW; after 3
warm-up steps one steady step (forward, backward, `optimizer.step()` with the float8 step
it runs) is counted on rank 0 with `sys.setprofile`. A count, not a time: deterministic.

The limits hold each recipe to the step's work: per weight one all-gather pack per step (the
backward's re-gather reuses it) and one write mark before the optimizer step (its kernels
may write below the wrappers' dispatch), per GEMM no call that does nothing, the float8 step's
structure and per-step decisions kept while the model holds. `python -m
tests.distributed.host_calls` prints the counts and the functions called most.
"""

from __future__ import annotations

from tests.distributed.host_calls import RECIPES, measure

LIMITS = {"tensorwise": 614, "rowwise": 655, "nvfp4": 799}


def test_a_steady_fsdp_step_stays_within_its_library_calls(tmp_path):
    counts = {r: sum(calls.values()) for r, calls in measure(str(tmp_path), RECIPES).items()}
    over = {r: (n, LIMITS[r]) for r, n in counts.items() if n > LIMITS[r]}
    assert not over, f"library calls per steady step (count, limit): {over}; all: {counts}"
