"""Small models for the library's tests: a Llama-style decoder (attention with RoPE and
grouped-query heads, SwiGLU or mixture-of-experts feed-forward), built here so that the
library's tests do not depend on the trainer's package.

``tokens -> tok_embeddings -> blocks -> norm -> output``; each block is pre-norm residual.
Every matmul is a bias-free ``nn.Linear`` (what the float8 conversion swaps), except the MoE
experts, whose 3-D weights use torchtitan's layout (``w1``, ``w3`` ``(E, hidden, dim)``,
``w2`` ``(E, dim, hidden)``). ``init_weights(seed)`` draws every parameter on the CPU from a
generator seeded by ``(seed, parameter name)``, so every rank and every sharding layout gets
the same values (an FSDP2 rank copies out its shard).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_float8.experts.grouped_mm import grouped_mm_hp


@dataclass(frozen=True, kw_only=True)
class MoEArgs:
    n_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 256
    score_fn: str = "softmax"  # or "sigmoid"
    shared_expert_hidden_dim: int = 0  # 0: no shared expert
    aux_loss_coef: float = 0.01


@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 256
    multiple_of: int = 256  # the SwiGLU hidden dim is rounded up to a multiple of this
    max_seq_len: int = 1024
    tie_embeddings: bool = False
    moe: MoEArgs | None = None

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        return self.multiple_of * math.ceil(int(8 * self.dim / 3) / self.multiple_of)


PRESETS = {
    "tiny": ModelArgs(),
    "moe_tiny": ModelArgs(moe=MoEArgs(n_experts=8, top_k=2, hidden_dim=256)),
}


def model_args(preset: str, **overrides: object) -> ModelArgs:
    """A preset ("tiny" or "moe_tiny") with fields replaced."""
    return dataclasses.replace(PRESETS[preset], **overrides)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=1e-5).type_as(x) * self.weight


def rope_tables(args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    exponents = torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim
    inv_freq = 1.0 / (10000.0**exponents)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        kv_dim = args.n_kv_heads * args.head_dim
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, kv_dim, bias=False)
        self.wv = nn.Linear(args.dim, kv_dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[:2]
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        repeats = self.n_heads // self.n_kv_heads  # TP divides both, so the ratio stays
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """E SwiGLU experts as 3-D weights; ``forward(x, num_tokens_per_expert)``, x sorted."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(num_tokens_per_expert, 0).to(torch.int32)

        def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return grouped_mm_hp(a, w.transpose(-2, -1), offs, a.dtype)

        return mm(F.silu(mm(x, self.w1)) * mm(x, self.w3), self.w2)


class MoE(nn.Module):
    """Top-k routing (router in float32), grouped experts, optional shared expert; keeps the
    Switch load-balancing loss of the last forward in ``aux_loss``."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.router = nn.Parameter(torch.empty(args.n_experts, dim))
        self.experts = GroupedExperts(dim, args.hidden_dim, args.n_experts)
        hidden = args.shared_expert_hidden_dim
        self.shared_expert = FeedForward(dim, hidden) if hidden else None
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        logits = F.linear(x2.float(), self.router.float())
        probs = logits.softmax(-1) if self.args.score_fn == "softmax" else logits.sigmoid()
        top_w, top_i = probs.topk(self.args.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        flat = top_i.reshape(-1)
        counts = torch.bincount(flat, minlength=self.args.n_experts)
        order = torch.argsort(flat, stable=True)
        token_of = order // self.args.top_k
        y = self.experts(x2[token_of], counts)
        y = y * top_w.reshape(-1)[order, None].to(y.dtype)
        out = torch.zeros_like(x2).index_add_(0, token_of, y.to(x2.dtype))
        if self.shared_expert is not None:
            out = out + self.shared_expert(x2)
        fraction = counts.float() / counts.sum().clamp(min=1)
        mean_prob = (probs / probs.sum(dim=-1, keepdim=True)).mean(dim=0)
        self.aux_loss = self.args.n_experts * (fraction * mean_prob).sum()
        return out.reshape(x.shape)


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The weighted sum of every MoE block's load-balancing loss (None without MoE)."""
    losses = [m.args.aux_loss_coef * m.aux_loss for m in model.modules() if isinstance(m, MoE)]
    return torch.stack(losses).sum() if losses else None


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim)
        moe = args.moe
        self.feed_forward = (
            FeedForward(args.dim, args.ffn_hidden_dim) if moe is None else MoE(args.dim, moe)
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Decoder-only LM; call ``init_weights(seed)`` after building."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.blocks = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(tokens)
        for block in self.blocks:
            h = block(h, cos, sin)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        for name, param in self.named_parameters():
            for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
                name = name.replace(wrapper, "")
            _copy_full_into(param, _initial_value(name, tuple(param.shape), self.args, seed))
        cos, sin = rope_tables(self.args)
        self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_sin.device)


def _initial_value(name: str, shape: tuple[int, ...], args: ModelArgs, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if len(shape) == 1:  # norm weights
        return torch.ones(shape)
    if name == "tok_embeddings.weight":
        std = 0.02 if args.tie_embeddings else 1.0
        return torch.empty(shape).normal_(0.0, std, generator=generator)
    std = args.dim**-0.5 if name == "output.weight" else 0.02
    if name.endswith((".wo.weight", ".w2.weight", ".experts.w2")):  # residual writers
        std = 0.02 / math.sqrt(2 * args.n_layers)
    # truncated to +-3 std by redrawing (nn.init.trunc_normal_ differs across torch versions)
    z = torch.empty(shape).normal_(generator=generator)
    while (outside := z.abs() > 3).any():
        z[outside] = torch.empty(int(outside.sum())).normal_(generator=generator)
    return z * std


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full CPU value into a parameter that may be a sharded DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):  # every rank slices its shard from the same full value
        local = distribute_tensor(
            full.to(param.device), param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def moe_batch(step: int, rank: int) -> torch.Tensor:
    """A rank's token batch at `step` for the small MoE tests: 2 sequences of 17 byte tokens,
    seeded by (step, rank)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 256, (2, 17), generator=g)


def moe_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of `tokens` plus the MoE blocks' load-balancing loss."""
    logits = model(tokens[:, :-1])
    ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    return ce + moe_aux_loss(model)
