"""What the lane compiles: a float8 transformer block per recipe, the grouped experts,
and the training step as torchtitan runs it (FSDP2 per block, each block compiled)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from f8train.gpu_codegen import codegen_backend, gpu_codegen
from f8train.gpu_kernels import GraphSummary, as_after_first_sync, summaries
from fsdp_float8 import CastConfig, Float8LinearConfig, NVFP4Config, convert_to_float8_training

DIM, HEADS, KV_HEADS, MULTIPLE_OF = 256, 4, 2, 256  # hidden 768
BATCH, SEQ = 2, 128  # 256 tokens: a multiple of every block size
LINEARS = 7  # wq wk wv wo w1 w2 w3
# recipes whose cubins the lane builds (every autotune config); the others stop at Triton
# source, the same code path minus ptxas
CUBIN = {"tensorwise", "rowwise", "mxfp8"}


def _delayed(**kw) -> Float8LinearConfig:
    delayed = CastConfig(scaling_type="delayed")
    return Float8LinearConfig(
        cast_config_input=delayed,
        cast_config_weight=delayed,
        cast_config_grad_output=delayed,
        **kw,
    )


def _static(**kw) -> Float8LinearConfig:
    return Float8LinearConfig(
        cast_config_weight=CastConfig(scaling_type="static", static_scale=64.0), **kw
    )


def config(recipe: str, **kw):
    if recipe == "nvfp4":
        return NVFP4Config(**kw)
    if recipe in ("delayed", "delayed_synced"):
        return _delayed(**kw)
    if recipe == "static":
        return _static(**kw)
    return Float8LinearConfig.from_recipe_name(recipe, **kw)


@dataclass(frozen=True)
class Compiled:
    dynamo_graphs: int
    graphs: tuple[GraphSummary, ...]
    kernels: int
    configs: int
    graph_breaks: int

    def of_kind(self, kind: str) -> list[GraphSummary]:
        return [g for g in self.graphs if g.kind == kind]


def _result(log) -> Compiled:
    from torch._dynamo.utils import counters

    return Compiled(
        len(log.dynamo_graphs),
        tuple(summaries(log)),
        len(log.kernels),
        sum(k["configs"] for k in log.kernels),
        sum(counters["graph_break"].values()),
    )


def block_args(n_layers: int = 1):
    from tests.models import model_args

    return model_args(
        "tiny",
        dim=DIM,
        n_heads=HEADS,
        n_kv_heads=KV_HEADS,
        multiple_of=MULTIPLE_OF,
        n_layers=n_layers,
    )


@functools.cache
def block(gpu: str, recipe: str, lib: str = "fsdp_float8") -> Compiled:
    """One transformer block, float8 per `recipe`, compiled for `gpu`: forward + backward.
    `lib` "torchao": torchao's conversion of the same block (`compare_fsdp`). "delayed":
    delayed scaling before the first sync; "delayed_synced": after it."""
    from tests.models import TransformerBlock, rope_tables

    args = block_args()
    with gpu_codegen(gpu, cubin=recipe in CUBIN and lib != "torchao") as log:
        with torch.device("meta"):
            model = TransformerBlock(args).to(torch.bfloat16)
        if lib == "torchao":
            import torchao.float8 as ao

            cfg = ao.Float8LinearConfig.from_recipe_name(recipe)
            ao.convert_to_float8_training(model, config=cfg)
        else:
            convert_to_float8_training(model, config=config(recipe))
        cos, sin = rope_tables(args)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = model.to_empty(device="cuda")
            x = torch.empty(BATCH, SEQ, DIM, device="cuda", dtype=torch.bfloat16)
            x.requires_grad_()
            cos, sin = cos[:SEQ].to("cuda"), sin[:SEQ].to("cuda")
        if recipe == "delayed_synced":
            assert as_after_first_sync(model) == LINEARS
        torch.compile(model, backend=codegen_backend(log), fullgraph=True)(x, cos, sin)
    return _result(log)


# small graphs of nn.Linear layers, beside the block: (layers, input shape, parameters:
# bf16, fp32, or fp32 under bf16 autocast)
GRAPHS = {
    "linear": ("linear", (4, 512, 1024), "bf16"),
    "linear_bias": ("linear_bias", (4, 512, 1024), "bf16"),
    # whole tensors of at most 8,192 values: Inductor reduces each in one kernel
    "linear_tiny": ("linear_tiny", (32, 64), "bf16"),
    "gelu_mlp": ("gelu_mlp", (2048, 1024), "bf16"),
    "relu_mlp3": ("relu_mlp3", (8, 256, 512), "bf16"),
    # float32 parameters under bf16 autocast (the layer casts its input to bf16)
    "linear_autocast": ("linear", (4, 512, 1024), "fp32_autocast"),
    # float32 parameters, no autocast: float32 outputs (rowwise: unit-scale GEMMs)
    "linear_fp32": ("linear", (4, 512, 1024), "fp32"),
    "layernorm_mlp": ("layernorm_mlp", (2048, 1024), "bf16"),
    "attention": ("attention", (4, 512, 1024), "bf16"),
}


class _Attention(nn.Module):
    """Causal self-attention: q, k, v and output projections around SDPA (8 heads)."""

    def __init__(self, dim: int = 1024, heads: int = 8):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


def _layers(name: str) -> nn.Module:
    if name == "linear":
        return nn.Sequential(nn.Linear(1024, 2048, bias=False))
    if name == "linear_tiny":
        return nn.Sequential(nn.Linear(64, 128, bias=False))
    if name == "linear_bias":
        return nn.Sequential(nn.Linear(1024, 2048))
    if name == "gelu_mlp":
        return nn.Sequential(
            nn.Linear(1024, 4096, bias=False), nn.GELU(), nn.Linear(4096, 1024, bias=False)
        )
    if name == "layernorm_mlp":
        return nn.Sequential(
            nn.LayerNorm(1024), nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)
        )
    if name == "attention":
        return _Attention()
    assert name == "relu_mlp3", name
    relu_layers = [m for _ in range(2) for m in (nn.Linear(512, 512, bias=False), nn.ReLU())]
    return nn.Sequential(*relu_layers, nn.Linear(512, 512, bias=False))


@functools.cache
def graph(kind: str, recipe: str, lib: str = "fsdp_float8") -> Compiled:
    """One of `GRAPHS`, float8 per `recipe` (`lib` "torchao": torchao's conversion),
    compiled for H100: forward + backward."""
    layers, shape, params = GRAPHS[kind]
    dtype = torch.bfloat16 if params == "bf16" else torch.float32
    autocast = params == "fp32_autocast"
    with gpu_codegen("h100", cubin=False) as log:
        with torch.device("meta"):
            model = _layers(layers).to(dtype)
        if lib == "torchao":  # not a dependency of the lane: `compare_graphs` only
            import torchao.float8 as ao

            cfg = ao.Float8LinearConfig.from_recipe_name(recipe)
            ao.convert_to_float8_training(model, config=cfg)
        else:
            convert_to_float8_training(model, config=config(recipe))
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = model.to_empty(device="cuda")
            x = torch.empty(shape, device="cuda", dtype=dtype, requires_grad=True)
        compiled = torch.compile(model, backend=codegen_backend(log), fullgraph=True)
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            compiled(x)
    return _result(log)


class _TitanExperts(nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))


@functools.cache
def experts(gpu: str, recipe: str, tokens: int = 256, n_experts: int = 4) -> Compiled:
    """Torchtitan-style grouped experts (w1, w2, w3) as `Float8GroupedExperts`, compiled."""
    from fsdp_float8.core import _compat
    from fsdp_float8.experts.modules import Float8GroupedExperts

    # what the device probe answers on an H100 (bf16 torch._grouped_mm runs on SM90); here
    # it would need a driver
    with gpu_codegen(gpu, cubin=False) as log, mock.patch.dict(_compat._GROUPED_MM, cuda=True):
        with torch.device("meta"):
            base = _TitanExperts(DIM, 512, n_experts).to(torch.bfloat16)
        module = Float8GroupedExperts.from_experts(base, config(recipe))
        with FakeTensorMode(allow_non_fake_inputs=True):
            module = module.to_empty(device="cuda")
            x = torch.empty(tokens, DIM, device="cuda", dtype=torch.bfloat16)
            x.requires_grad_()
            counts = torch.full((n_experts,), tokens // n_experts, device="cuda")
        torch.compile(module, backend=codegen_backend(log), fullgraph=True)(x, counts)
    return _result(log)


def _convert_torchao(model: nn.Module, recipe: str) -> None:
    """torchao's float8 (not a dependency: `compare_fsdp` only): float8 all-gather where
    torchao has it (tensorwise), bf16 all-gather otherwise."""
    import dataclasses

    import torchao.float8 as ao

    cfg = ao.Float8LinearConfig.from_recipe_name(recipe)
    cfg = dataclasses.replace(cfg, enable_fsdp_float8_all_gather=recipe == "tensorwise")
    ao.convert_to_float8_training(model, config=cfg, module_filter_fn=lambda m, f: f != "output")


@functools.cache
def fsdp_step(
    recipe: str, ac: bool, world: int = 8, n_blocks: int = 2, lib: str = "fsdp_float8"
) -> Compiled:
    """The training step as torchtitan runs it, on rank 1 of a fake world: float8 all-gather,
    activation checkpointing per block when `ac`, each block compiled then `fully_shard`,
    the root sharded too. One forward compiles both graphs of every block. `lib`
    "torchao": torchao's conversion instead, its scales precomputed as its docs ask."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from tests.fakecuda.fake_fsdp import fake_world
    from tests.models import Transformer

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cfg = config(recipe, enable_fsdp_float8_all_gather=True)
    with fake_world((world,)) as mesh, gpu_codegen("h100", cubin=False) as log:
        backend = codegen_backend(log)
        with FakeTensorMode(allow_non_fake_inputs=True):
            with torch.device("cuda"):
                model = Transformer(block_args(n_blocks))
                tokens = torch.randint(0, 256, (BATCH, SEQ))
            if lib == "torchao":
                _convert_torchao(model, recipe)
            else:
                convert_to_float8_training(
                    model, config=cfg, module_filter_fn=lambda m, fqn: fqn != "output"
                )
                if recipe == "delayed_synced":
                    assert as_after_first_sync(model) == LINEARS * n_blocks
            for i, blk in enumerate(model.blocks):
                if ac:
                    blk = checkpoint_wrapper(blk)
                blk = torch.compile(blk, backend=backend, fullgraph=True)
                fully_shard(blk, mesh=mesh, mp_policy=mp)
                model.blocks[i] = blk
            fully_shard(model, mesh=mesh, mp_policy=mp)
            if lib == "torchao" and recipe == "tensorwise":
                from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

                precompute_float8_dynamic_scale_for_fsdp(model)
            logits = model(tokens)
            assert logits.shape == (BATCH, SEQ, 256)
    return _result(log)
