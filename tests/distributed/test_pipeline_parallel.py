"""Pipeline parallelism x FSDP2 x float8 on 4 gloo ranks: mesh ("pp", "dp") = (2, 2), 4
residual blocks in 2 stages (`tests/distributed/pp_cases.py`), each stage converted,
`fully_shard`ed on its dp sub-mesh and given AdamW; torch.distributed.pipelining's GPipe and
1F1B, stages built with example inputs and without (`PipelineStage(..., input_args=None)`,
as torchtitan builds them: pipelining then runs each stage once before step 0 on
uninitialized input to infer shapes, which must not feed delayed-scaling history).

Checked per case against a one-process reference (same microbatches, gradients accumulated
the same way): the per-step losses within the reduction-order tolerance below; the scale
collectives (all-reduce MAX) of each stage: 2 at step 0 (the first scales, then the refresh
after the optimizer step) and 1 per later step for tensorwise (float8 all-gather) and
delayed scaling, none for rowwise; all of them on the stage's dp group, none elsewhere.

Tolerance: the references in three equally valid reduction orders (`REFERENCE_ORDERS`)
differ by up to ~1e-7 per loss (measured, float32); the pipeline is one more order, so
step t allows SPREAD_MULTIPLE x their running max spread + FLOOR_EPS x eps x (t + 1) x
|loss| (`order_tolerances`, shared with the FSDP2 parity tests). The pipeline measured
within 1.2e-7 of the references; delayed scaling that recorded the shape-inference run
was 9.5e-2 off at step 1.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.distributed.launcher import cpu_mesh, run_distributed
from tests.distributed.pp_cases import REFERENCE_ORDERS, PPCase, train_pipeline, train_reference
from tests.distributed.test_fsdp_parity import order_tolerances

# the default lane: the bug's case (delayed, no example inputs) under both schedules, and
# each other recipe once; ~25 s on a loaded 2-core CPU (one spawn for all)
DEFAULT_CASES = [
    PPCase(recipe="delayed", schedule="gpipe", example_inputs=False),
    PPCase(recipe="delayed", schedule="1f1b", example_inputs=False),
    PPCase(recipe="tensorwise", schedule="1f1b", example_inputs=False),
    PPCase(recipe="rowwise", schedule="gpipe", example_inputs=True),
]
SLOW_CASES = [
    PPCase(recipe=r, schedule=s, example_inputs=e, microbatches=4)
    for r in ("tensorwise", "rowwise", "delayed")
    for s in ("gpipe", "1f1b")
    for e in (True, False)
]


def _grid(rank: int, world_size: int, cases: list[PPCase]) -> dict:
    """The pipeline runs of every case, then this rank's share of the one-process
    references (one thread per rank: a loaded CPU runs them ~20x faster than threaded)."""
    mesh = cpu_mesh((2, 2), ("pp", "dp"))
    runs = [train_pipeline(case, mesh, rank) for case in cases]
    refs = {
        i: [train_reference(case, order) for order in REFERENCE_ORDERS]
        for i, case in enumerate(cases)
        if i % world_size == rank
    }
    return {"runs": runs, "refs": refs}


def _check(cases: list[PPCase], results: list[dict]) -> None:
    all_refs = {i: r for result in results for i, r in result["refs"].items()}
    for i, case in enumerate(cases):
        refs = all_refs[i]
        tols = order_tolerances(refs)
        per_step = [1] * case.steps if case.recipe != "rowwise" else [0] * case.steps
        if case.recipe != "rowwise":
            per_step[0] = 2
        for rank, result in enumerate(results):
            got = result["runs"][i]
            assert [c["dp"] for c in got["counts"]] == per_step, (case, rank, got["counts"])
            assert all(c["other"] == 0 for c in got["counts"]), (case, rank, got["counts"])
            if got["stage"] == 0:
                continue
            for t, (loss, tol) in enumerate(zip(got["losses"], tols, strict=True)):
                assert abs(loss - refs[0][t]) <= tol, (case, rank, t, loss, refs[0][t], tol)


def test_pipeline_stages_match_one_process(tmp_path) -> None:
    cases = [replace(c, steps=3) for c in DEFAULT_CASES]
    _check(cases, run_distributed(_grid, 4, tmp_path, cases, timeout_s=300))


@pytest.mark.slow
@pytest.mark.timeout(900)  # 12 cases: ~1.5 min idle, several on a loaded 2-core CPU
def test_pipeline_grid_4_microbatches(tmp_path) -> None:
    _check(SLOW_CASES, run_distributed(_grid, 4, tmp_path, SLOW_CASES, timeout_s=900))
