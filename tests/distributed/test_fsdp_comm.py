"""What travels: bytes and counts of the collectives of an FSDP2 + float8 training step.

Counted at the dispatcher with `CollectiveCounter`, on 2 ranks:
- float8 all-gather: each converted weight travels at 1 byte per element, in forward and
  in backward after reshard (a tensorwise scale travels in no collective: every rank
  derives the same; rowwise row scales and their inverses add 8 bytes per row inside the same
  payload);
- the float8 refresh (no float8 call in the loop): exactly one all-reduce per step, in the
  optimizer step (the float8 step's post hook), for 2 or 8 layers, dynamic or delayed, and
  one more before the first forward (the ranks' configs are compared through the store, no
  collective); none in backward; rowwise: none at all;
- without the hook each float8-gathered weight all-reduces its own amax per all-gather;
- each all-gather's size follows torchao's FSDP2 test rule (1 byte per converted weight
  element, other parameters at their itemsize), recorded as that test records it.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from fsdp_float8 import Float8Linear
from fsdp_float8.tools.comm_stats import CollectiveCounter
from tests.distributed.float8_cases import (
    Case,
    batch,
    build_model,
    convert,
    fsdp_all_gathers,
    loss_of,
    shard,
)
from tests.distributed.launcher import cpu_mesh, run_distributed


def _expected_all_gather_bytes(model, world_size: int, fp8: bool, bf16: bool, rowwise: bool):
    """Bytes one rank sends per all-gather pass, split by block/root, from the param shapes:
    float8 weights 1 byte/element (+ a float32 scale and its inverse per row when rowwise),
    others 4 or 2."""
    fp8_ids = {id(m.weight) for m in model.modules() if isinstance(m, Float8Linear)}
    per_param = {}
    for name, p in model.named_parameters():
        rows = math.ceil(p.shape[0] / world_size)
        shard_numel = rows * math.prod(p.shape[1:])
        if fp8 and id(p) in fp8_ids:
            per_param[name] = shard_numel + (8 * rows if rowwise else 0)
        else:
            per_param[name] = shard_numel * (2 if bf16 else 4)
    blocks = sum(v for k, v in per_param.items() if k.startswith("blocks."))
    return {"blocks": blocks, "root": sum(per_param.values()) - blocks}


def _step_stats(rank, world_size, case: Case, steps: int = 3) -> dict:
    mesh = cpu_mesh(world_size)
    model = build_model(case)
    if case.recipe != "off":
        convert(model, case, all_gather=case.fp8_all_gather)
    fp8_ag = case.fp8_all_gather and case.recipe != "off"
    rowwise = case.recipe.startswith("rowwise")
    expected = _expected_all_gather_bytes(model, world_size, fp8_ag, case.mp_bf16, rowwise)
    shard(model, case, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per_step = []
    for step in range(steps):
        with CollectiveCounter() as fwd:
            loss = loss_of(model, case, batch(case, step, rank, world_size))
        with CollectiveCounter() as bwd:
            loss.backward()
        with CollectiveCounter() as post:
            opt.step()
            opt.zero_grad()
        per_step.append(
            {name: _phase(c) for name, c in (("fwd", fwd), ("bwd", bwd), ("post", post))}
        )
    return {"expected": expected, "steps": per_step}


def _phase(c: CollectiveCounter) -> dict:
    return {
        "all_gather_bytes": c.bytes("all_gather"),
        "all_gather": fsdp_all_gathers(c),
        "all_reduce": c.count("all_reduce"),
        "reduce_scatter": c.count("reduce_scatter"),
    }


def _grid(rank, world_size, cases):
    return [_step_stats(rank, world_size, c) for c in cases]


BASE = Case(scaling="dynamic", steps=3)
BF16 = replace(BASE, recipe="off", mp_bf16=True, fp8_all_gather=False)
FP8_AG_BF16 = replace(BASE, mp_bf16=True)
FP8_AG = BASE
FP8_NO_PRECOMPUTE = replace(BASE, precompute=False)
DELAYED = replace(BASE, scaling="delayed")
PRECOMPUTE_8_LAYERS = replace(BASE, n_layers=8)
ROWWISE = replace(BASE, recipe="rowwise")
ROWWISE_GW_HP = replace(BASE, recipe="rowwise_with_gw_hp")
CASES = [
    BF16,
    FP8_AG_BF16,
    FP8_AG,
    FP8_NO_PRECOMPUTE,
    DELAYED,
    PRECOMPUTE_8_LAYERS,
    ROWWISE,
    ROWWISE_GW_HP,
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

    # the refresh: 1 all-reduce per step, in the optimizer step (the float8 step's post
    # hook), none in backward, any depth, dynamic or delayed; before the first forward,
    # the first scales (the ranks' configs are compared through the store: no collective)
    for case in (FP8_AG, FP8_AG_BF16, PRECOMPUTE_8_LAYERS, DELAYED):
        for step, s in enumerate(by_case[case]["steps"]):
            phases = (s["fwd"]["all_reduce"], s["bwd"]["all_reduce"], s["post"]["all_reduce"])
            assert phases == (int(step == 0), 0, 1), (case.name, step)
            assert s["fwd"]["all_gather"] == n_blocks[case] + 1  # FSDP2's alone

    # rowwise weights: row scales are local to the shard, no amax collective at all
    for case in (ROWWISE, ROWWISE_GW_HP):
        for s in by_case[case]["steps"]:
            assert sum(s[phase]["all_reduce"] for phase in ("fwd", "bwd", "post")) == 0

    # without the refresh hook: one amax all-reduce per float8 weight per all-gather
    n_fp8 = 7 * FP8_NO_PRECOMPUTE.n_layers  # wq wk wv wo w1 w2 w3 per block
    s = by_case[FP8_NO_PRECOMPUTE]["steps"][1]
    assert (s["fwd"]["all_reduce"], s["bwd"]["all_reduce"]) == (n_fp8, n_fp8)


# -- torchao's all-gather size rule, counted as its FSDP2 test counts ---------------------------
def _torchao_sizes(rank, world_size):
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from fsdp_float8 import Float8LinearConfig, convert_to_float8_training

    sizes: list[int] = []
    # FSDP2 calls all_gather_single on torch 2.13+, all_gather_into_tensor before
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}

    def recording(name):
        def gather(output, *args, **kwargs):
            sizes.append(output.numel() * output.itemsize)
            return originals[name](output, *args, **kwargs)

        return gather

    torch.manual_seed(42)
    blocks = [nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)) for _ in range(3)]
    model = convert_to_float8_training(
        nn.Sequential(*blocks),
        config=Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True),
    )
    for block in model:
        fully_shard(block, mesh=cpu_mesh(world_size))
    fully_shard(model, mesh=cpu_mesh(world_size))
    # torchao's rule: 1 byte per weight element, the other parameters at their itemsize
    expected = [
        sum(
            p.numel() * (1 if n.endswith("weight") else p.itemsize)
            for n, p in block.named_parameters()
        )
        for block in model
    ]
    for name in names:
        setattr(dist, name, recording(name))
    try:
        model(torch.randn(16, 16)).sum().backward()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return sizes, expected


def test_all_gather_sizes_follow_torchaos_rule(tmp_path):
    for sizes, expected in run_distributed(_torchao_sizes, 2, tmp_path, timeout_s=60):
        # forward: each block once; backward: each block again after its reshard
        assert sizes == expected + expected[::-1], (sizes, expected)
