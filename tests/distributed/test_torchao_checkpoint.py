"""A torchao.float8 checkpoint loads into a model converted with fsdp_float8, exactly,
in processes that never import torchao.

The fixture (tests/fixtures/torchao_float8_tensorwise, written by torchao 0.18 with
`tests.distributed.torchao_checkpoint_cases`) pickles torchao's float8 weight class in a
DCP checkpoint, in per-rank `torch.save`d sharded state dicts and in a one-process state
dict. On 2 gloo ranks, every weight and optimizer tensor loaded from each equals the plain
copy stored beside it, bit for bit, and one more training step gives the same loss as a
model given the plain copy directly (the float8 scales are recomputed from the loaded
weights). The same with a checkpoint torchao writes now: tests/integrations/
test_torchao_checkpoint_extras.py.
"""

from __future__ import annotations

from tests.distributed.launcher import run_distributed
from tests.distributed.torchao_checkpoint_cases import (
    FIXTURE,
    load_with_fsdp_float8,
    mesh_pickle_loads,
)


def check_loaded(reports: list[dict]) -> None:
    for rank, r in enumerate(reports):
        assert r["torchao_imported"] == [], (rank, r["torchao_imported"])
        assert r["dcp"] == [] and r["single_pt"] == [], (rank, r)
        # the per-rank files need torch 2.13+ (their DeviceMesh pickle: mesh_pickle_loads)
        assert r["rank_pt"] == ([] if mesh_pickle_loads() else None), (rank, r["rank_pt"])
        resumed, reference = r["losses"]
        assert resumed == reference, (rank, resumed, reference)


def test_torchao_checkpoint_fixture_loads_exactly_without_torchao(tmp_path):
    assert (FIXTURE / "dcp" / ".metadata").exists()
    check_loaded(run_distributed(load_with_fsdp_float8, 2, tmp_path, str(FIXTURE), timeout_s=240))
