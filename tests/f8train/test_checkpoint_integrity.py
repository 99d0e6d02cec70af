"""Damaged checkpoints and changed settings, on 2 gloo ranks in-process (one spawn).

A small FSDP2 model saves checkpoints at steps 1 and 2 through the trainer's
``Checkpointer``; each case copies them, damages step 2 (or 1) the way a disk, a copy or a
user would, and calls ``find_resume`` (what ``f8train.train`` runs before building its
model) on both ranks. Checked: the message names the file and what is wrong with it and
the previous intact checkpoint; both ranks reach the same decision; no checkpoint is lost
(the intact one is untouched, the damaged one kept under a new name or left in place);
and the fallback checkpoint loads the exact step-1 weights (checked once: the load path is
the same for every kind of damage).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from f8train.checkpoint import MANIFEST, Checkpointer, ModelOptimizerState
from tests.distributed.launcher import run_distributed
from tests.f8train.checkpoint_setup import find_resume_outcome, model_and_optimizer, resume_args

SETTINGS = {"recipe": "tensorwise", "scaling": "dynamic", "seed": 0}


def _full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def _tree(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``root``."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files
    }


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # the middle of a shard file: tensor bytes
    path.write_bytes(bytes(data))


def _flip_byte_and_unfinished_step_3(ck: Path) -> None:
    _flip_byte(ck / "__0_0.distcp")
    (ck.parent / "step_00000003").mkdir()  # DCP finished, the process died before the manifest
    shutil.copy(ck / ".metadata", ck.parent / "step_00000003" / ".metadata")


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "truncated_shard": lambda ck: _truncate(ck / "__1_0.distcp"),
    "flipped_tensor_byte": _flip_byte_and_unfinished_step_3,
    "truncated_metadata": lambda ck: _truncate(ck / ".metadata"),
    "deleted_shard": lambda ck: (ck / "__1_0.distcp").unlink(),
    "truncated_manifest": lambda ck: _truncate(ck / MANIFEST),
    "manifest_a_list": lambda ck: (ck / MANIFEST).write_text("[]"),
    "manifest_a_string": lambda ck: (ck / MANIFEST).write_text('"x"'),
}


def _decide(args: argparse.Namespace, ckpt: Checkpointer, settings: dict) -> dict:
    """find_resume's outcome: the step it resumes from, or the message it stopped with."""
    point, stopped, stderr = find_resume_outcome(args, ckpt, settings)
    if stopped is not None:
        return {"stopped": stopped, "stderr": stderr}
    return {"step": point.step if point else None, "stderr": stderr, "point": point}


def _cases(rank: int, world_size: int, tmp: str) -> dict:
    tmp_path = Path(tmp)
    model, opt = model_and_optimizer(world_size)
    pristine = Checkpointer(tmp_path / "pristine" / "checkpoints", keep=3, is_main=rank == 0)
    saved = {}
    for step in (1, 2):
        model(torch.randn(4, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        saved[step] = _full_weights(model)
        pristine.save(step, {"app": ModelOptimizerState(model, opt)}, SETTINGS)
    results: dict = {"manifest": json.loads((pristine.path_for(2) / MANIFEST).read_text())}

    def fresh(name: str, damage, step: int = 2) -> Checkpointer:
        out = tmp_path / name
        ckpt = Checkpointer(out / "checkpoints", keep=3, is_main=rank == 0)
        if rank == 0:
            shutil.copytree(pristine.root, ckpt.root)
            damage(ckpt.path_for(step))
        dist.barrier()
        return ckpt

    for name, damage in DAMAGE.items():
        ckpt = fresh(name, damage)
        before = _tree(ckpt.root)
        outcome = _decide(resume_args(ckpt.root.parent), ckpt, SETTINGS)
        point = outcome.pop("point")
        if name == "flipped_tensor_byte":  # one load is enough: the same path for all
            ckpt.load(point.path, {"app": ModelOptimizerState(model, opt)})
            outcome["weights_equal_step_1"] = all(
                torch.equal(v, saved[1][k]) for k, v in _full_weights(model).items()
            )
        outcome["renamed_to"] = [str(p.relative_to(ckpt.root)) for p in point.damaged]
        outcome["tree_before"], outcome["tree_after"] = before, _tree(ckpt.root)
        dist.barrier()
        results[name] = outcome
    ckpt = fresh("explicit", DAMAGE["truncated_shard"])
    before = _tree(ckpt.root)
    results["explicit"] = _decide(
        resume_args(ckpt.root.parent, str(ckpt.path_for(2))), ckpt, SETTINGS
    )
    results["explicit"]["unchanged"] = _tree(ckpt.root) == before
    ckpt = fresh("none_intact", DAMAGE["deleted_shard"], step=1)
    shutil.rmtree(ckpt.path_for(2)) if rank == 0 else None
    dist.barrier()
    before = _tree(ckpt.root)
    results["none_intact"] = _decide(resume_args(ckpt.root.parent), ckpt, SETTINGS)
    results["none_intact"]["unchanged"] = _tree(ckpt.root) == before
    ckpt = fresh("only_unfinished", lambda ck: (ck / MANIFEST).unlink(), step=1)
    shutil.rmtree(ckpt.path_for(2)) if rank == 0 else None
    dist.barrier()
    before = _tree(ckpt.root)
    results["only_unfinished"] = _decide(resume_args(ckpt.root.parent), ckpt, SETTINGS)
    results["none_intact"]["unchanged"] = _tree(ckpt.root) == before
    results["only_unfinished"]["unchanged"] = _tree(ckpt.root) == before
    results["root"] = str(tmp_path)
    return results


def test_damaged_checkpoints_are_named_and_none_is_lost(tmp_path: Path) -> None:
    ranks = run_distributed(_cases, 2, tmp_path, str(tmp_path), timeout_s=120)
    for name in (
        *DAMAGE,
        "explicit",
        "none_intact",
        "only_unfinished",
    ):  # one decision, whatever the rank
        assert {k: v for k, v in ranks[0][name].items() if k != "stderr"} == {
            k: v for k, v in ranks[1][name].items() if k != "stderr"
        }, name
    r = ranks[0]
    root = Path(r["root"])
    files = r["manifest"]["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for name, entry in files.items():
        data = (root / "pristine/checkpoints/step_00000002" / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert r["manifest"]["settings"] == SETTINGS and r["manifest"]["step"] == 2

    expected_problem = {
        "truncated_shard": "__1_0.distcp: ",
        "flipped_tensor_byte": "__0_0.distcp: contents changed since the save (sha256 differs)",
        "truncated_metadata": ".metadata: ",
        "deleted_shard": "__1_0.distcp: missing (listed in the manifest, not on disk)",
        "truncated_manifest": f"{MANIFEST}: {MANIFEST} cannot be read",
        "manifest_a_list": f"{MANIFEST}: {MANIFEST} is not a format-1 manifest with a file "
        "list (a JSON list, not an object)",
        "manifest_a_string": f"{MANIFEST}: {MANIFEST} is not a format-1 manifest with a file "
        "list (a JSON str, not an object)",
    }
    for name, problem in expected_problem.items():
        out = r[name]
        ck = root / name / "checkpoints"
        assert out["step"] == 1, (name, out)
        warning = out["stderr"]
        assert f"WARNING: checkpoint {ck / 'step_00000002'} is damaged" in warning, warning
        assert problem in warning, (name, warning)
        assert f"resuming from the previous intact checkpoint {ck / 'step_00000001'}" in warning
        assert ranks[1][name]["stderr"] == ""  # rank 0 speaks for all
        # no checkpoint lost: every file is still there, the damaged one under a new name
        assert out["renamed_to"] == ["step_00000002.damaged"]
        moved = {
            k.replace("step_00000002/", "step_00000002.damaged/"): v
            for k, v in out["tree_before"].items()
        }
        assert out["tree_after"] == moved
    assert r["flipped_tensor_byte"]["weights_equal_step_1"]  # the fallback loads step 1
    unfinished = root / "flipped_tensor_byte" / "checkpoints" / "step_00000003"
    assert (
        f"note: {unfinished} has DCP files but no {MANIFEST}" in r["flipped_tensor_byte"]["stderr"]
    )
    assert "bytes on disk" in r["truncated_shard"]["stderr"]
    assert "bytes on disk" in r["truncated_metadata"]["stderr"]

    ck = root / "explicit" / "checkpoints"
    stop = r["explicit"]["stopped"]
    assert f"--resume {ck / 'step_00000002'}: checkpoint is damaged" in stop
    assert "__1_0.distcp: " in stop and "bytes on disk" in stop
    assert f"resume with --resume {ck / 'step_00000001'}" in stop
    assert r["explicit"]["unchanged"]

    stop = r["none_intact"]["stopped"]
    assert "no intact checkpoint under" in stop and "__1_0.distcp: missing" in stop
    assert "another --out" in stop and r["none_intact"]["unchanged"]

    # DCP's files all there but no manifest (a lost manifest, or a run from before
    # manifests): in doubt, so the run stops and names it; nothing deleted
    out = r["only_unfinished"]
    unfinished = root / "only_unfinished" / "checkpoints" / "step_00000001"
    assert "checkpoint folders in doubt" in out["stopped"] and out["unchanged"]
    assert f"--resume {unfinished}" in out["stopped"]
