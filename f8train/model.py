"""A Llama-style decoder-only transformer used as the workload for float8 training.

Mental model: ``tokens -> tok_embeddings -> blocks[0..n_layers) -> norm -> output -> logits``.
Each block is pre-norm residual:

    h = x + attention(attention_norm(x))      # q/k/v/o linears, RoPE, GQA, causal SDPA
    out = h + feed_forward(ffn_norm(h))       # SwiGLU: w2(silu(w1(x)) * w3(x))

With ``ModelArgs.moe`` set, ``feed_forward`` is a mixture of experts (``f8train.moe.MoE``:
router, grouped 3-D expert weights, optional shared expert, load-balancing loss).

Every matmul is a bias-free ``nn.Linear`` (the layers the float8 conversion swaps); the
embedding, the norms and the output head are ordinary modules. ``Transformer.blocks`` is an
``nn.ModuleList`` so FSDP2 can ``fully_shard`` each block and then the root.

Initialization is explicit and deterministic: build the model (on any device, ``meta``
included), move it (``to_empty``) if needed, then call ``init_weights(seed)``. Every
parameter is drawn on the CPU from its own generator seeded by ``(seed, its name)``, so all
ranks, all devices and all sharding layouts get identical values; with FSDP2 each rank
copies out its own shard. The rotary tables are non-persistent buffers that
``init_weights`` recomputes (``to_empty`` leaves them as garbage).

``forward`` returns logits in the output head's compute dtype (float32 for float32
parameters, the param dtype under FSDP2 mixed precision); upcast before the loss.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from f8train.model_shapes import PRESETS, ModelArgs, flops_per_token, model_args, param_count
from f8train.moe import MoE

__all__ = [
    "PRESETS",
    "Attention",
    "FeedForward",
    "ModelArgs",
    "RMSNorm",
    "Transformer",
    "TransformerBlock",
    "flops_per_token",
    "model_args",
    "num_params",
    "param_count",
]


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, normalized in float32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).type_as(x)
        return normed * self.weight


def rope_tables(
    args: ModelArgs, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each ``(max_seq_len, head_dim // 2)`` float32."""
    exponents = torch.arange(0, args.head_dim, 2, device=device, dtype=torch.float64)
    inv_freq = 1.0 / (args.rope_theta ** (exponents / args.head_dim))
    positions = torch.arange(args.max_seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs ``(x[2i], x[2i+1])`` of ``x: (batch, seq, heads, head_dim)``."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos = cos[None, :, None, :]  # broadcast over batch and heads
    sin = sin[None, :, None, :]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.kv_heads
        self.head_dim = args.head_dim
        kv_dim = self.n_kv_heads * self.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, kv_dim, bias=False)
        self.wv = nn.Linear(args.dim, kv_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self.wq(x).view(batch, seq_len, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq_len, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq_len, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        repeats = self.n_heads // self.n_kv_heads
        if repeats > 1:  # each kv head serves `repeats` consecutive query heads
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if args.moe is None:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        else:
            hidden = args.moe.shared_expert_hidden_dim
            shared = FeedForward(args.dim, hidden) if hidden else None
            self.feed_forward = MoE(args.dim, args.moe, shared)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Decoder-only LM; call ``init_weights(seed)`` after building (see module docstring)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.blocks = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(args, self.tok_embeddings.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens: (batch, seq_len)`` int64 -> logits ``(batch, seq_len, vocab_size)``."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens has shape {tuple(tokens.shape)}; expected (batch, seq_len)")
        seq_len = tokens.shape[1]
        if seq_len > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_seq_len={self.args.max_seq_len}; "
                "build the model with model_args(..., max_seq_len=N) for N >= seq_len"
            )
        cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        h = self.tok_embeddings(tokens)
        for block in self.blocks:
            h = block(h, cos, sin)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministically (re)initialize every parameter and the rotary buffers."""
        for name, param in self.named_parameters():
            name = _canonical_name(name)
            full = _initial_value(name, tuple(param.shape), self.args, seed)
            _copy_full_into(param, full)
        cos, sin = rope_tables(self.args, self.rope_cos.device)
        self.rope_cos = cos
        self.rope_sin = sin


def _canonical_name(name: str) -> str:
    """Drop wrapper prefixes (torch.compile, activation checkpointing) from a param name."""
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def _initial_value(name: str, shape: tuple[int, ...], args: ModelArgs, seed: int) -> torch.Tensor:
    """The float32 CPU init of parameter ``name``; depends only on (seed, name, shape)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if len(shape) == 1:  # RMSNorm weights
        return torch.ones(shape)
    if name == "tok_embeddings.weight":
        # A tied embedding is also the output head: keep logits O(1) with a small std.
        std = 0.02 if args.tie_embeddings else 1.0
        return torch.empty(shape).normal_(0.0, std, generator=generator)
    if name == "output.weight":
        std = args.dim**-0.5
        return _trunc_normal(shape, std, generator)
    std = 0.02
    if name.endswith(
        (".wo.weight", ".w2.weight", ".experts.w2")
    ):  # residual-stream writers: depth-scaled
        std = 0.02 / math.sqrt(2 * args.n_layers)
    return _trunc_normal(shape, std, generator)


def _trunc_normal(shape: tuple[int, ...], std: float, generator: torch.Generator) -> torch.Tensor:
    """N(0, std^2) truncated to +-3 std, by redrawing: standard normals from ``normal_``, and
    those outside [-3, 3] drawn again from the same generator until none is left. Built from
    ``normal_`` because ``nn.init.trunc_normal_`` changed its algorithm after torch 2.11 (other
    values for the same seed); ``normal_`` gives the same values on 2.11 to 2.15
    (tests/unit/test_model.py pins a few)."""
    z = torch.empty(shape).normal_(generator=generator)
    outside = z.abs() > 3
    while outside.any():
        z[outside] = torch.empty(int(outside.sum())).normal_(generator=generator)
        outside = z.abs() > 3
    return z * std


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full CPU value into a parameter that may be an FSDP2-sharded DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # src_data_rank=None: no communication, every rank slices its shard from its own
        # identical copy of `full` with the same chunking FSDP2 uses.
        local = distribute_tensor(
            full.to(param.device), param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def num_params(model: nn.Module, exclude_embedding: bool = True) -> int:
    """Distinct parameters of ``model`` (global sizes for DTensors), minus the embedding.

    For a tied model the shared matrix is counted once, so excluding the embedding also
    excludes the head; use ``param_count`` for a FLOP count.
    """
    total = sum(p.numel() for p in model.parameters())  # parameters() is deduplicated
    if exclude_embedding:
        embeddings = {
            id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding)
        }
        total -= sum(embeddings.values())
    return total
