"""Shared pieces of the float8 tensor-parallel tests: a small Llama model under the TP plan
(optionally FSDP2 over the dp dim of a (dp, tp) mesh) against a single-process float8
reference on the same data.

The plan is torchtitan's layout: sequence-parallel norms and embedding; wq/wk/wv and w1/w3
colwise, wo and w2 rowwise (outputs reduce-scattered to sequence shards); the attention and
MLP inputs all-gathered in float8 (`PrepareFloat8ModuleInput`) when every consumer casts its
input tensorwise to one dtype for both of its GEMMs, in high precision otherwise.

The reference runs on each rank with no collective: the same model, each dp rank's slice of
the global batch in turn, gradients of the slices averaged by hand (FSDP2 averages over dp),
so its float8 casts see exactly the tensors a dp rank casts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fsdp_float8 import (
    CastConfig,
    Float8ColwiseParallel,
    Float8Linear,
    Float8LinearConfig,
    Float8RowwiseParallel,
    PrepareFloat8ModuleInput,
    convert_to_float8_training,
)
from fsdp_float8.core.gemms import Gemm, Operand
from tests.models import Transformer, model_args


@dataclass(frozen=True)
class TPCase:
    recipe: str = "tensorwise"  # tensorwise | rowwise | static
    fp8_all_gather: bool = False  # FSDP2 float8 weight all-gather (2-D only)
    dp: int = 1
    tp: int = 2
    steps: int = 6
    rows: int = 2  # sequences per dp rank
    n_layers: int = 2

    @property
    def name(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.__dict__.items())


def float8_config(case: TPCase) -> Float8LinearConfig:
    if case.recipe == "static":
        base = Float8LinearConfig(
            cast_config_input=CastConfig(scaling_type="static", static_scale=64.0),
            cast_config_weight=CastConfig(scaling_type="static", static_scale=2048.0),
            cast_config_grad_output=CastConfig(scaling_type="static", static_scale=2.0**20),
        )
    else:
        base = Float8LinearConfig.from_recipe_name(case.recipe)
    return replace(base, enable_fsdp_float8_all_gather=case.fp8_all_gather)


def build_model(case: TPCase, *, all_gather: bool | None = None) -> nn.Module:
    # heads and kv heads divisible by tp; the SwiGLU hidden dim 176 is too (multiple_of 16)
    args = model_args(
        "tiny", dim=64, n_layers=case.n_layers, n_heads=4, n_kv_heads=2, multiple_of=16,
        max_seq_len=32,
    )  # fmt: skip
    model = Transformer(args)
    model.init_weights(0)
    config = float8_config(case if all_gather is None else replace(case, fp8_all_gather=all_gather))
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, f: f != "output")
    return model


def _prepare(consumers: list[nn.Module], n_inputs: int):
    layouts, desired = (
        (Shard(1),) + (None,) * (n_inputs - 1),
        (Replicate(),) + (None,) * (n_inputs - 1),
    )
    key = (Operand.INPUT, Gemm.OUTPUT)
    float8 = all(
        isinstance(m, Float8Linear)
        and m.plan.shares_cast(Operand.INPUT, Gemm.OUTPUT, Gemm.GRAD_WEIGHT)
        for m in consumers
    )
    if float8 and len({m.plan.dtypes[key] for m in consumers}) == 1:
        return PrepareFloat8ModuleInput(
            input_layouts=layouts,
            desired_input_layouts=desired,
            float8_dtype=consumers[0].plan.dtypes[key],
        )
    return PrepareModuleInput(input_layouts=layouts, desired_input_layouts=desired)


def apply_tensor_parallel(model: Transformer, tp_mesh) -> None:
    """The plan of the module docstring, in place, over the 1-D `tp_mesh`."""

    def col(m):
        return Float8ColwiseParallel() if isinstance(m, Float8Linear) else ColwiseParallel()

    def row(m):
        style = Float8RowwiseParallel if isinstance(m, Float8Linear) else RowwiseParallel
        return style(output_layouts=Shard(1))

    head = Float8ColwiseParallel if isinstance(model.output, Float8Linear) else ColwiseParallel
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": head(input_layouts=Shard(1), output_layouts=Replicate()),
    })  # fmt: skip
    for block in model.blocks:
        attn, ffn = block.attention, block.feed_forward
        plan = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
        plan["attention"] = _prepare([attn.wq, attn.wk, attn.wv], 3)  # (x, cos, sin)
        plan["feed_forward"] = _prepare([ffn.w1, ffn.w3], 1)
        for name, m in (("wq", attn.wq), ("wk", attn.wk), ("wv", attn.wv), ("wo", attn.wo)):
            plan[f"attention.{name}"] = row(m) if name == "wo" else col(m)
        for name, m in (("w1", ffn.w1), ("w3", ffn.w3), ("w2", ffn.w2)):
            plan[f"feed_forward.{name}"] = row(m) if name == "w2" else col(m)
        parallelize_module(block, tp_mesh, plan)
        attn.n_heads //= tp_mesh.size()
        attn.n_kv_heads //= tp_mesh.size()


def global_batch(case: TPCase, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7000 + step)
    return torch.randint(0, 256, (case.dp * case.rows, 17), generator=g)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def parallelize(case: TPCase, mesh) -> nn.Module:
    """The TP (and, with dp > 1, FSDP2) model on a ("dp", "tp") mesh."""
    model = build_model(case)
    apply_tensor_parallel(model, mesh["tp"])
    if case.dp > 1:
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def train_parallel(case: TPCase, mesh, model: nn.Module | None = None) -> list[float]:
    """Per step: this dp rank's loss on its slice of the global batch."""
    model = model or parallelize(case, mesh)
    dp_rank = mesh["dp"].get_local_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    for step in range(case.steps):
        tokens = global_batch(case, step)[dp_rank * case.rows : (dp_rank + 1) * case.rows]
        loss = loss_of(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_reference(case: TPCase, dp_rank: int, *, reverse_rows: bool = False) -> list[float]:
    """Single process, no collective: dp rank `dp_rank`'s loss per step, the gradients of
    the dp slices averaged. `reverse_rows` feeds each slice's sequences in reverse order:
    the same loss and gradients mathematically (a mean over the same tokens, causal
    attention within each sequence; max-based scales do not depend on order), other float32
    summation orders in the token reductions: a second valid reference."""
    # rowwise weights under float8 all-gather re-cast grad_input's weight from the row-cast
    # weight (sharded or not): the reference keeps that config
    model = build_model(case, all_gather=case.fp8_all_gather and case.recipe == "rowwise")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    for step in range(case.steps):
        tokens = global_batch(case, step)
        mine = None
        for i in range(case.dp):
            rows = tokens[i * case.rows : (i + 1) * case.rows]
            loss = loss_of(model, rows.flip(0) if reverse_rows else rows)
            (loss / case.dp).backward()
            mine = loss.item() if i == dp_rank else mine
        opt.step()
        opt.zero_grad()
        losses.append(mine)
    return losses
