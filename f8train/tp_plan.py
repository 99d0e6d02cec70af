"""The tensor-parallel plan of ``f8train.model``, torchtitan's layout (docs/api.md, Tensor
parallelism): sequence-parallel norms, colwise wq/wk/wv/w1/w3, rowwise wo/w2 (outputs back
to sequence shards), the embedding rowwise, the head colwise. A ``Float8Linear`` gets
fsdp_float8's style, any other linear torch's; a block's input is gathered in float8 when
every consumer casts it tensorwise. Apply after the float8 swap, before ``fully_shard``.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from f8train.model import Transformer
from fsdp_float8 import Float8Linear
from fsdp_float8.core.config import Gemm, Operand
from fsdp_float8.tensor_parallel.input import PrepareFloat8ModuleInput
from fsdp_float8.tensor_parallel.styles import Float8ColwiseParallel, Float8RowwiseParallel


def _colwise(m: nn.Module, **layouts):
    return (Float8ColwiseParallel if isinstance(m, Float8Linear) else ColwiseParallel)(**layouts)


def _rowwise(m: nn.Module):
    style = Float8RowwiseParallel if isinstance(m, Float8Linear) else RowwiseParallel
    return style(output_layouts=Shard(1))


def _float8_input_dtype(consumers: list[nn.Module]):
    """The float8 dtype the consumers' input can be all-gathered in, or None: each consumer
    must be a Float8Linear whose input cast is tensorwise and shared by its two GEMMs, all
    of one dtype."""
    cast = (Operand.INPUT, Gemm.OUTPUT, Gemm.GRAD_WEIGHT)
    if not all(isinstance(m, Float8Linear) and m.plan.shares_cast(*cast) for m in consumers):
        return None
    dtypes = {m.plan.dtypes[(Operand.INPUT, Gemm.OUTPUT)] for m in consumers}
    return dtypes.pop() if len(dtypes) == 1 else None


def _prepare(consumers: list[nn.Module], n_inputs: int):
    layouts = (Shard(1),) + (None,) * (n_inputs - 1)
    desired = (Replicate(),) + (None,) * (n_inputs - 1)
    style = dict(input_layouts=layouts, desired_input_layouts=desired)
    dtype = _float8_input_dtype(consumers)
    if dtype is None:
        return PrepareModuleInput(**style)
    return PrepareFloat8ModuleInput(**style, float8_dtype=dtype)


def block_plan(block: nn.Module) -> dict[str, object]:
    attn, ffn = block.attention, block.feed_forward
    return {
        "attention_norm": SequenceParallel(),
        "attention": _prepare([attn.wq, attn.wk, attn.wv], 3),  # (x, cos, sin)
        "attention.wq": _colwise(attn.wq),
        "attention.wk": _colwise(attn.wk),
        "attention.wv": _colwise(attn.wv),
        "attention.wo": _rowwise(attn.wo),
        "ffn_norm": SequenceParallel(),
        "feed_forward": _prepare([ffn.w1, ffn.w3], 1),
        "feed_forward.w1": _colwise(ffn.w1),
        "feed_forward.w3": _colwise(ffn.w3),
        "feed_forward.w2": _rowwise(ffn.w2),
    }


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh) -> Transformer:
    """Parallelize `model` in place over the 1-D `tp_mesh` (see the module docstring)."""
    tp, args = tp_mesh.size(), model.args
    dims = {
        "n_heads": args.n_heads,
        "n_kv_heads": args.kv_heads,
        "ffn_hidden_dim": args.ffn_hidden_dim,
        "vocab_size": args.vocab_size,
    }
    bad = {k: v for k, v in dims.items() if v % tp}
    if bad:
        raise ValueError(
            f"tensor parallel size {tp} does not divide {bad}; choose --tp dividing every "
            f"one of {dims} (the sequence length must be a multiple of it too)"
        )
    if args.moe is not None:
        raise ValueError(
            "tensor parallelism of mixture-of-experts blocks is not supported (the plan "
            "shards the dense SwiGLU feed-forward); use a dense preset, or --tp 1 for MoE"
        )
    if args.tie_embeddings:
        raise ValueError(
            "tensor parallelism of a model with tied embeddings is not supported (the "
            "embedding is sharded by vocab rows, the head by output columns); untie them"
        )
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": _colwise(model.output, input_layouts=Shard(1), output_layouts=Replicate()),
    }
    parallelize_module(model, tp_mesh, plan)
    for block in model.blocks:
        parallelize_module(block, tp_mesh, block_plan(block))
    return model
