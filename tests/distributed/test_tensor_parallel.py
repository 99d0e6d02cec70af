"""Float8 tensor parallelism (TP 2, sequence parallel) on 2 gloo ranks, one spawn:

- parity: a small Llama model under the plan in tp_cases (float8 attention and MLP, sequence-parallel
  norms and embedding) trains like the single-process float8 model on the same data, for
  tensorwise, rowwise, rowwise_with_gw_hp and static scaling, to the reduction-order
  tolerance of test_fsdp_parity (`order_tolerances`: 4x the running spread of two
  references that sum tokens in different orders, plus an 8-eps-per-step floor);
- bytes: each sequence-parallel activation all-gather sends 1 byte per element (uint8 views
  of float8; its tensorwise scale comes from an all-reduced amax, so no scale bytes);
- scale collectives: the MAX all-reduces of one step, counted per recipe and bounded in size;
- refusals: combinations TP cannot run with single-process scales raise with a remedy;
- uneven sequence shards: 15 tokens on 2 ranks (DTensor shards of 8 and 7) are gathered in
  float8 with the same output and input gradient as the high-precision gather (it used to
  kill a rank in gloo: 1024 vs 896 bytes); fewer tokens than ranks is refused on every rank.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    parallelize_module,
)

from fsdp_float8 import (
    CastConfig,
    Float8ColwiseParallel,
    Float8LinearConfig,
    Float8RowwiseParallel,
    PrepareFloat8ModuleInput,
    convert_to_float8_training,
)
from fsdp_float8.tools.comm_stats import CollectiveCounter
from tests.distributed.launcher import cpu_mesh, run_distributed
from tests.distributed.test_fsdp_parity import order_tolerances
from tests.distributed.tp_cases import (
    TPCase,
    global_batch,
    loss_of,
    parallelize,
    train_parallel,
    train_reference,
)

PARITY = [TPCase(recipe=r) for r in ("tensorwise", "rowwise", "rowwise_with_gw_hp", "static")]
# TP alone with a float8 all-gather config: the weights' local shards are FSDP2 wrappers,
# cast by the layer itself (no FSDP2 here)
PARITY.append(TPCase(recipe="tensorwise", fp8_all_gather=True))
# What one training step's MAX all-reduces are, per transformer block, counted by hand from
# the layout table in fsdp_float8/tensor_parallel/styles.py (colwise: wq wk wv w1 w3, rowwise: wo w2):
# tensorwise forward: 2 float8 activation gathers' amaxes + 5 colwise weights + 2 rowwise
#   x (input, weight) = 11; backward: 5 colwise grad_outputs (shared by both GEMMs) = 5;
# rowwise forward: 2 rowwise x (input rows, weight rows) = 4 (the activations are gathered
#   in high precision: no float8 gather); backward: 5 colwise x (grad_input's weight columns,
#   grad_output rows) = 10;
# static: no amax anywhere.
MAX_REDUCES_PER_BLOCK = {"tensorwise": (11, 5), "rowwise": (4, 10), "static": (0, 0)}


def _grid(rank: int, world_size: int) -> dict:
    mesh = cpu_mesh((1, world_size), ("dp", "tp"))
    parity = [
        (
            train_parallel(c, mesh),
            [train_reference(c, 0), train_reference(c, 0, reverse_rows=True)],
        )
        for c in PARITY
    ]
    comm = {r: _one_step(TPCase(recipe=r), mesh) for r in MAX_REDUCES_PER_BLOCK}
    uneven = _uneven_sequence(mesh["tp"])
    refusals = _refusals(mesh)
    return {"parity": parity, "comm": comm, "refusals": refusals, "uneven": uneven,
            "batch_sharded": _batch_sharded_input(mesh["tp"])}  # fmt: skip


def _batch_sharded_input(tp) -> dict:
    """A DTensor input sharded on dim 0 into a style declared for Shard(1): torch's
    PrepareModuleInput takes a DTensor as its placements say; so does the float8 one."""
    hp = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    fp8 = PrepareFloat8ModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    got, want = _uneven_gather(tp, fp8, 16, dim=0), _uneven_gather(tp, hp, 16, dim=0)
    return {"out_equal": torch.equal(got[0], want[0]), "grad_equal": torch.equal(got[1], want[1])}


def _uneven_gather(tp, style, tokens: int, dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and input gradient of a float8 colwise layer fed through ``style`` from a
    DTensor of ``tokens`` tokens sharded on ``dim`` (the same full input on every rank)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False))
    convert_to_float8_training(model, config=Float8LinearConfig())
    parallelize_module(model, tp, style)
    parallelize_module(model, tp, {"0": Float8ColwiseParallel()})
    x = distribute_tensor(torch.randn(2, tokens, 64), tp, [Shard(dim)]).requires_grad_()
    out = model(x)  # this rank's 64 output columns (use_local_output)
    out.square().sum().backward()
    return out.detach(), x.grad.full_tensor()


def _uneven_sequence(tp) -> dict:
    hp = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    fp8 = PrepareFloat8ModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    got, want = _uneven_gather(tp, fp8, 15), _uneven_gather(tp, hp, 15)
    local = distribute_tensor(torch.zeros(1, 15, 1), tp, [Shard(1)]).to_local().shape[1]
    try:
        _uneven_gather(tp, fp8, 1)
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    return {
        "local_tokens": local,
        "out_equal": torch.equal(got[0], want[0]),
        "grad_equal": torch.equal(got[1], want[1]),
        "out_shape": tuple(got[0].shape),
        "refused": refused,
    }


def _one_step(case: TPCase, mesh) -> dict:
    model = parallelize(case, mesh)
    tokens = global_batch(case, 0)
    with CollectiveCounter() as fwd:
        loss = loss_of(model, tokens)
    with CollectiveCounter() as bwd:
        loss.backward()

    def summary(c: CollectiveCounter) -> dict:
        maxes = [r for r in c.records if r.reduce_op == "max"]
        return {
            "uint8_gathers": [r.bytes for r in c.records if r.dtype == torch.uint8],
            "max_reduces": len(maxes),
            "max_reduce_bytes": max((r.bytes for r in maxes), default=0),
        }

    return {"fwd": summary(fwd), "bwd": summary(bwd), "tokens": tuple(tokens[:, :-1].shape)}


def _refusals(mesh) -> dict[str, str]:
    tp = mesh["tp"]
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = "no error"
        except (TypeError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"

    def converted(config, bias=False):
        return convert_to_float8_training(
            nn.Sequential(nn.Linear(32, 64, bias=bias), nn.Linear(64, 32, bias=bias)),
            config=config,
        )

    delayed = Float8LinearConfig(cast_config_input=CastConfig(scaling_type="delayed"))
    rowwise = Float8LinearConfig.from_recipe_name("rowwise")
    attempt(
        "delayed",
        lambda: parallelize_module(converted(delayed), tp, {"0": Float8ColwiseParallel()}),
    )
    attempt(
        "plain_linear", lambda: parallelize_module(nn.Linear(32, 64), tp, Float8ColwiseParallel())
    )
    attempt(
        "rowwise_bias",
        lambda: parallelize_module(converted(None, bias=True), tp, {"1": Float8RowwiseParallel()}),
    )
    attempt(
        "float8_gather_rowwise_recipe",
        lambda: parallelize_module(
            converted(rowwise), tp, PrepareFloat8ModuleInput(input_layouts=None)
        ),
    )

    def block_recipe():
        mxfp8 = Float8LinearConfig.from_recipe_name("mxfp8")
        model = convert_to_float8_training(nn.Sequential(nn.Linear(256, 256)), config=mxfp8)
        parallelize_module(model, tp, {"0": Float8ColwiseParallel()})

    attempt("block_recipe", block_recipe)

    def torch_style_on_float8():
        model = parallelize_module(converted(None), tp, {"0": ColwiseParallel()})
        model(torch.randn(4, 32))

    attempt("torch_colwise_on_float8", torch_style_on_float8)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_grid, 2, tmp_path_factory.mktemp("tp"), timeout_s=300)


def test_tp_parity_with_single_process(results):
    for rank, res in enumerate(results):
        for case, (tp, refs) in zip(PARITY, res["parity"], strict=True):
            for t, (got, want, tol) in enumerate(zip(tp, refs[0], order_tolerances(refs))):
                assert abs(got - want) <= tol, f"rank {rank} {case.name} step {t}: {got} vs {want}"
            assert len(set(tp)) > 1, f"{case.name}: the loss never changed: {tp}"
    assert results[0]["parity"] == results[1]["parity"]  # TP ranks see the same losses


@pytest.mark.parametrize("recipe", list(MAX_REDUCES_PER_BLOCK))
def test_tp_collectives_one_step(results, recipe):
    res = results[0]["comm"][recipe]
    blocks, (batch, seq) = TPCase().n_layers, res["tokens"]
    fwd_max, bwd_max = MAX_REDUCES_PER_BLOCK[recipe]
    assert res["fwd"]["max_reduces"] == blocks * fwd_max
    assert res["bwd"]["max_reduces"] == blocks * bwd_max
    # a scale all-reduce is one float32 per scale: 4 bytes (tensorwise) or one per row of
    # the largest operand dim (rowwise), never activation-sized
    bound = 4 if recipe == "tensorwise" else 4 * max(batch * seq, 176)
    for phase in ("fwd", "bwd"):
        assert res[phase]["max_reduce_bytes"] <= bound
    # sequence-parallel activations: per block 2 float8 gathers (attention, MLP) in forward,
    # each 1 byte per element of this rank's (batch, seq / 2, dim) shard; none in backward
    dim = 64
    float8_gathers = 2 * blocks if recipe != "rowwise" else 0
    assert res["fwd"]["uint8_gathers"] == [batch * (seq // 2) * dim] * float8_gathers
    assert res["bwd"]["uint8_gathers"] == []


def test_tp_refusals(results):
    got = results[0]["refusals"]
    assert got["delayed"].startswith("ValueError: delayed scaling under tensor parallelism")
    assert "convert_to_float8_training first" in got["plain_linear"]
    assert got["rowwise_bias"].startswith(
        "ValueError: Float8RowwiseParallel of a Float8Linear with a bias"
    )
    assert "tensorwise input cast" in got["float8_gather_rowwise_recipe"]
    assert "Float8ColwiseParallel" in got["torch_colwise_on_float8"]
    assert "supports tensorwise and rowwise (axiswise) scales, got Blockwise" in got["block_recipe"]


def test_uneven_sequence_shards_gather_in_float8(results):
    for rank, res in enumerate(results):
        got = res["uneven"]
        assert got["local_tokens"] == (8, 7)[rank]  # the shards really are uneven
        assert got["out_shape"] == (2, 15, 64)  # every token, this rank's columns
        assert got["out_equal"] and got["grad_equal"], got  # as the hp gather, bit for bit
        assert got["refused"].startswith(
            "PrepareFloat8ModuleInput: the sequence dim (1) has 1 tokens for 2 tensor-parallel"
        ), got["refused"]


def test_a_dtensor_input_is_gathered_on_its_own_shard_dim(results):
    for res in results:
        got = res["batch_sharded"]
        assert got == {"out_equal": True, "grad_equal": True}, got
