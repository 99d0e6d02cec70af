"""torch.compile and activation checkpointing with FSDP2 + float8 all-gather.

- Per-block torch.compile (aot_eager: the dynamo + AOTAutograd tracing that inductor also
  uses, fast on CPU) gives the same losses as the eager replicated reference for dynamic
  (with and without the refresh hook), delayed and static scaling.
- Activation checkpointing issues no all-gather beyond what FSDP2 issues for bf16 with the
  same checkpointing, and delayed amaxes end up the same with and without recompute.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fsdp_float8 import Float8Linear, convert_to_float8_training
from fsdp_float8.tools.comm_stats import CollectiveCounter
from tests.distributed.float8_cases import (
    Case,
    batch,
    build_model,
    float8_config,
    float8_filter,
    fsdp_all_gathers,
    loss_of,
    shard,
    train_fsdp,
    train_reference,
)
from tests.distributed.launcher import cpu_mesh, run_distributed

COMPILED = [
    Case(compile=True, steps=6),
    Case(compile=True, precompute=False, steps=6),
    Case(compile=True, scaling="delayed", steps=6),
    Case(compile=True, scaling="static", steps=6),
]


def _compiled_grid(rank, world_size, cases):
    mesh = cpu_mesh(world_size)
    out = []
    for c in cases:
        # fresh caches per case, the DEFAULT recompile limit: a per-step recompile (e.g. a
        # host counter read in the compiled forward) would exceed it and fail here
        torch._dynamo.reset()
        out.append((train_fsdp(c, mesh, rank, world_size), train_reference(c, rank, world_size)))
    return out


def test_per_block_compile_matches_eager(tmp_path):
    results = run_distributed(_compiled_grid, 2, tmp_path, COMPILED, timeout_s=600)
    for per_case in results:
        for case, (fsdp, ref) in zip(COMPILED, per_case, strict=True):
            assert fsdp == ref, case.name


def _ac_stats(rank, world_size, case: Case) -> dict:
    model = build_model(case)
    if case.recipe != "off":
        convert_to_float8_training(
            model,
            config=float8_config(case, all_gather=case.fp8_all_gather),
            module_filter_fn=float8_filter,
        )
    shard(model, case, cpu_mesh(world_size))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CollectiveCounter() as counter:
        loss = loss_of(model, case, batch(case, 0, rank, world_size))
        loss.backward()
    amaxes = {
        n.replace("_checkpoint_wrapped_module.", ""): b.clone()
        for n, b in model.named_buffers()
        if n.split(".")[-1].startswith("fp8_amax_")
    }
    opt.step()
    del opt
    n_fp8 = sum(isinstance(m, Float8Linear) for m in model.modules())
    return {"all_gather": fsdp_all_gathers(counter), "amaxes": amaxes, "n_fp8": n_fp8}


def _ac_grid(rank, world_size, cases):
    return [_ac_stats(rank, world_size, c) for c in cases]


def test_activation_checkpointing_adds_no_all_gather(tmp_path):
    bf16_ac = Case(recipe="off", fp8_all_gather=False, mp_bf16=True, activation_checkpointing=True)
    fp8_ac = Case(activation_checkpointing=True)
    delayed, delayed_ac = (
        Case(scaling="delayed"),
        Case(scaling="delayed", activation_checkpointing=True),
    )
    cases = [bf16_ac, fp8_ac, replace(fp8_ac, activation_checkpointing=False), delayed, delayed_ac]
    r = run_distributed(_ac_grid, 2, tmp_path, cases, timeout_s=300)[0]
    assert r[1]["all_gather"] == r[0]["all_gather"] == r[2]["all_gather"]
    # recompute casts again but records the same amaxes (max is idempotent)
    assert r[3]["amaxes"].keys() == r[4]["amaxes"].keys() and r[3]["amaxes"]
    for name, value in r[3]["amaxes"].items():
        assert torch.equal(value, r[4]["amaxes"][name]), name
