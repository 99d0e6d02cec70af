"""What travels: bytes and counts of the collectives of an FSDP2 + float8 training step.

Counted at the dispatcher with `CollectiveCounter`, on 2 ranks:
- float8 all-gather: each converted weight travels at 1 byte per element, in forward and
  in backward after reshard (a tensorwise scale travels in no collective: every rank
  derives the same; rowwise row scales add 4 bytes per row inside the same payload);
- precompute: exactly one amax all-reduce per step, for 2 or 8 layers, none in fwd/bwd;
- delayed scaling: exactly one all-reduce per step (the sync);
- the first step is bounded: precompute before the first forward means no per-weight
  all-reduce storm.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from fsdp_float8 import (
    Float8Linear,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
    sync_float8_amax_and_scale_history,
)
from fsdp_float8.comm_stats import CollectiveCounter
from tests.distributed.float8_cases import (
    Case,
    after_step,
    batch,
    build_model,
    float8_config,
    float8_filter,
    loss_of,
    shard,
)
from tests.distributed.launcher import cpu_mesh, run_distributed


def _expected_all_gather_bytes(model, world_size: int, fp8: bool, bf16: bool, rowwise: bool):
    """Bytes one rank sends per all-gather pass, split by block/root, from the param shapes:
    float8 weights 1 byte/element (+ a float32 scale per row when rowwise), others 4 or 2."""
    fp8_ids = {id(m.weight) for m in model.modules() if isinstance(m, Float8Linear)}
    per_param = {}
    for name, p in model.named_parameters():
        rows = math.ceil(p.shape[0] / world_size)
        shard_numel = rows * math.prod(p.shape[1:])
        if fp8 and id(p) in fp8_ids:
            per_param[name] = shard_numel + (4 * rows if rowwise else 0)
        else:
            per_param[name] = shard_numel * (2 if bf16 else 4)
    blocks = sum(v for k, v in per_param.items() if k.startswith("blocks."))
    return {"blocks": blocks, "root": sum(per_param.values()) - blocks}


def _step_stats(rank, world_size, case: Case, steps: int = 3) -> dict:
    mesh = cpu_mesh(world_size)
    model = build_model(case)
    if case.recipe != "off":
        config = float8_config(case, all_gather=case.fp8_all_gather)
        convert_to_float8_training(model, config=config, module_filter_fn=float8_filter)
    fp8_ag = case.fp8_all_gather and case.recipe != "off"
    rowwise = case.recipe.startswith("rowwise")
    expected = _expected_all_gather_bytes(model, world_size, fp8_ag, case.mp_bf16, rowwise)
    shard(model, case, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per_step = []
    with CollectiveCounter() as setup:
        if case.precompute and case.fp8_all_gather and case.scaling == "dynamic":
            precompute_float8_dynamic_scale_for_fsdp(model)
        if case.scaling == "delayed" and case.precompute:
            sync_float8_amax_and_scale_history(model)
    for step in range(steps):
        with CollectiveCounter() as fwd:
            loss = loss_of(model, case, batch(case, step, rank, world_size))
        with CollectiveCounter() as bwd:
            loss.backward()
        opt.step()
        opt.zero_grad()
        with CollectiveCounter() as post:
            after_step(model, case, None)
        per_step.append(
            {
                name: {
                    "all_gather_bytes": c.bytes("all_gather"),
                    "all_gather": c.count("all_gather"),
                    "all_reduce": c.count("all_reduce"),
                    "reduce_scatter": c.count("reduce_scatter"),
                }
                for name, c in (("fwd", fwd), ("bwd", bwd), ("post", post))
            }
        )
    return {"expected": expected, "setup_all_reduce": setup.count("all_reduce"), "steps": per_step}


def _grid(rank, world_size, cases):
    return [_step_stats(rank, world_size, c) for c in cases]


BASE = Case(scaling="dynamic", steps=3)
BF16 = replace(BASE, recipe="off", mp_bf16=True, fp8_all_gather=False)
FP8_AG_BF16 = replace(BASE, mp_bf16=True)
FP8_AG = BASE
FP8_NO_PRECOMPUTE = replace(BASE, precompute=False)
DELAYED = replace(BASE, scaling="delayed", precompute=False)
DELAYED_SEEDED = replace(BASE, scaling="delayed")  # sync before the first forward
PRECOMPUTE_8_LAYERS = replace(BASE, n_layers=8)
ROWWISE = replace(BASE, recipe="rowwise", precompute=False)
ROWWISE_GW_HP = replace(BASE, recipe="rowwise_with_gw_hp", precompute=False)
CASES = [
    BF16,
    FP8_AG_BF16,
    FP8_AG,
    FP8_NO_PRECOMPUTE,
    DELAYED,
    PRECOMPUTE_8_LAYERS,
    ROWWISE,
    ROWWISE_GW_HP,
    DELAYED_SEEDED,
]


def test_collective_bytes_and_counts(tmp_path):
    results = run_distributed(_grid, 2, tmp_path, CASES, timeout_s=300)[0]
    by_case = dict(zip(CASES, results, strict=True))
    n_blocks = {c: c.n_layers for c in CASES}

    # bytes: forward gathers every group; with reshard_after_forward (root included in
    # torch 2.13) backward gathers every group again
    for case in (BF16, FP8_AG_BF16, FP8_AG, ROWWISE, ROWWISE_GW_HP):
        r = by_case[case]
        exp = r["expected"]
        for s in r["steps"]:
            assert s["fwd"]["all_gather_bytes"] == exp["blocks"] + exp["root"], case.name
            assert s["bwd"]["all_gather_bytes"] == exp["blocks"] + exp["root"], case.name
            assert s["fwd"]["all_gather"] == n_blocks[case] + 1

    # precompute: 1 all-reduce per step (the precompute), none in forward/backward, any depth
    for case in (FP8_AG, FP8_AG_BF16, PRECOMPUTE_8_LAYERS):
        r = by_case[case]
        assert r["setup_all_reduce"] == 1, case.name  # first step bounded too
        for s in r["steps"]:
            assert (s["fwd"]["all_reduce"], s["bwd"]["all_reduce"], s["post"]["all_reduce"]) == (
                0,
                0,
                1,
            ), case.name

    # rowwise weights: row scales are local to the shard, no amax collective at all
    for case in (ROWWISE, ROWWISE_GW_HP):
        for s in by_case[case]["steps"]:
            assert sum(s[phase]["all_reduce"] for phase in ("fwd", "bwd", "post")) == 0

    # without precompute: one amax all-reduce per float8 weight per all-gather
    n_fp8 = 7 * FP8_NO_PRECOMPUTE.n_layers  # wq wk wv wo w1 w2 w3 per block
    s = by_case[FP8_NO_PRECOMPUTE]["steps"][1]
    assert (s["fwd"]["all_reduce"], s["bwd"]["all_reduce"]) == (n_fp8, n_fp8)

    # delayed: the first step bootstraps each weight once, then exactly 1 (the sync) per step
    steps = by_case[DELAYED]["steps"]
    assert steps[0]["fwd"]["all_reduce"] == 7 * DELAYED.n_layers
    for s in steps[1:]:
        total = s["fwd"]["all_reduce"] + s["bwd"]["all_reduce"] + s["post"]["all_reduce"]
        assert total == 1
    # ... unless a sync before the first forward seeded the weight scales: 1 collective
    # then, and exactly 1 (the sync) in every step including the first
    seeded = by_case[DELAYED_SEEDED]
    assert seeded["setup_all_reduce"] == 1
    for s in seeded["steps"]:
        assert (s["fwd"]["all_reduce"], s["bwd"]["all_reduce"], s["post"]["all_reduce"]) == (
            0,
            0,
            1,
        )
