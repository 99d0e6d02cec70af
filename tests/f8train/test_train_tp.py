"""The real ``torchrun --nproc_per_node 4 -m f8train.train --tp 2`` (tiny model, CPU, gloo).

- default suite: 20 steps of float8 tensorwise training on a (dp 2, tp 2) mesh: the loss
  falls, the run reports its mesh, and its checkpoint is written;
- slow: a checkpoint saved at (dp 2, tp 2) resumes at (dp 4, tp 1) with the losses of an
  uninterrupted run. Tolerance: two uninterrupted runs, one per layout, do the same
  arithmetic up to the order of their reductions (TP splits contractions, FSDP sums
  gradients over another number of ranks); their spread is what reduction order alone does,
  and the resumed run, one more mix of the two, must stay within `order_tolerances` of
  both (test_fsdp_parity: 4x the running spread + an 8-eps-per-step floor). The recipe is
  `rowwise_with_gw_hp`, whose scales do not depend on how the batch is split over dp ranks
  (per-token rows and whole weights, power-of-2 scales; grad_weight in high precision):
  with tensorwise scales a dp rank's activation amax covers its own rows, so another dp
  size casts other bits and the runs would differ by more than reduction order.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_fsdp_parity import order_tolerances
from tests.f8train.launch import metrics, output_of, run_info, train
from tests.f8train.test_train_launch import resume_from

STEPS = 20


def test_tp2_dp2_trains_20_steps(tmp_path: Path) -> None:
    out = tmp_path / "tp"
    args = ("--tp", "2", "--steps", str(STEPS), "--val-every", "0", "--ckpt-every", "0")
    result = train(out, *args, nproc=4, timeout=600)
    assert result.returncode == 0, output_of(result)
    assert "mesh {'shard': 2, 'tp': 2}" in result.stdout
    assert "tp=2" in result.stdout  # the config line
    losses = [r["loss"] for r in metrics(out)]
    assert len(losses) == STEPS
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    assert run_info(out)["mesh"] == {"shard": 2, "tp": 2}
    assert (out / "checkpoints" / f"step_{STEPS:08d}").is_dir()


RESHARD = ("--recipe", "rowwise_with_gw_hp", "--steps", str(STEPS), "--val-every", "0")


@pytest.mark.slow
def test_checkpoint_at_dp2_tp2_resumes_at_dp4_tp1(tmp_path: Path) -> None:
    a, c, b = tmp_path / "dp2_tp2", tmp_path / "dp4_tp1", tmp_path / "resumed"
    for out, extra in ((a, ("--tp", "2", "--ckpt-every", "10")), (c, ())):
        result = train(out, *RESHARD, *extra, nproc=4, timeout=900)
        assert result.returncode == 0, output_of(result)
    resume_from(a, 10, b)
    result = train(b, *RESHARD, nproc=4, timeout=900)
    assert result.returncode == 0, output_of(result)
    assert "resumed from" in result.stdout and "at step 10" in result.stdout
    runs = [[r["loss"] for r in metrics(p)] for p in (a, c, b)]
    assert [len(r) for r in runs] == [STEPS] * 3
    tols = order_tolerances(runs[:2])
    for t in range(10, STEPS):
        for ref in runs[:2]:
            assert abs(runs[2][t] - ref[t]) <= tols[t], (t, runs, tols)
