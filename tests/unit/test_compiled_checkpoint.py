"""A checkpointed block of float8 linears, compiled: its forward keeps only what
checkpointing keeps (the block's inputs and parameters), and backward recomputes the float8
casts and GEMMs, on every supported torch (`core._compat.checkpoint_tags_reach_functions`
mends torch 2.11, whose tags for recompute stop at a custom `autograd.Function`)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from fsdp_float8 import Float8LinearConfig, convert_to_float8_training
from fsdp_float8.core import _compat


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 128, bias=False)
        self.down = torch.nn.Linear(128, 64, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _run(recipe: str, checkpointed: bool, compiled: bool):
    torch.manual_seed(0)
    block = _Block()
    config = Float8LinearConfig.from_recipe_name(recipe)
    config = type(config)(**{**config.__dict__, "emulate": True})  # any torch's CPU GEMMs
    convert_to_float8_training(block, config=config)
    model = checkpoint_wrapper(block) if checkpointed else block
    graphs: list = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return gm

    if compiled:
        # the partitioner Inductor uses (it recomputes what is tagged, and what is cheap)
        backend = aot_autograd(
            fw_compiler=keep, bw_compiler=keep, partition_fn=min_cut_rematerialization_partition
        )
        model = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(32, 64, requires_grad=True)
    model(x).square().sum().backward()
    torch._dynamo.reset()
    grads = [x.grad, block.up.weight.grad, block.down.weight.grad]
    saved = []
    if graphs:
        (output,) = [n for n in graphs[0].graph.nodes if n.op == "output"]
        saved = [a for a in output.args[0][1:] if isinstance(a, torch.fx.Node)]  # [0]: the out
    return grads, saved


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_checkpointed_float8_block_keeps_only_its_inputs(recipe):
    grads, saved = _run(recipe, checkpointed=True, compiled=True)
    kept = [(node.name, node.op) for node in saved]
    # the block's input and its two weights: graph inputs, nothing the forward computed
    assert all(op == "placeholder" for _, op in kept), kept
    assert len(kept) == 3, kept
    # not checkpointed, the same block keeps float8 casts for its backward
    _, plain = _run(recipe, checkpointed=False, compiled=True)
    assert any(node.op != "placeholder" for node in plain)
    # and the recompute gives the eager gradients, bit for bit
    eager, _ = _run(recipe, checkpointed=True, compiled=False)
    for got, want in zip(grads, eager, strict=True):
        assert torch.equal(got, want)


def test_the_mend_applies_where_the_walk_is():
    from torch._higher_order_ops import wrap

    walk = getattr(getattr(wrap, "TagActivationCheckpoint", None), "tag_nodes", None)
    assert _compat.CHECKPOINT_TAGS_MENDED == (walk is not None)
    if walk is not None:
        assert walk.reaches_subgraphs
        assert _compat.checkpoint_tags_reach_functions()  # idempotent
