"""Model shapes: `ModelArgs` (the transformer's shape, FFN width derived Llama-style) and
`MoEArgs` (its mixture-of-experts feed-forward), the named presets (`PRESETS`, CPU-sized and
GPU-sized dense and MoE models), `model_args` (a preset with fields replaced), and the counts
derived from shapes alone: `param_count` and `flops_per_token` (for MFU). The modules that
use them live in `f8train.model` and `f8train.moe`; this module imports neither."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = [
    "PRESETS",
    "ModelArgs",
    "MoEArgs",
    "flops_per_token",
    "model_args",
    "param_count",
]


@dataclass(frozen=True, kw_only=True)
class MoEArgs:
    n_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 256  # each expert's SwiGLU hidden size
    score_fn: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    shared_expert_hidden_dim: int = 0  # 0: no shared expert
    aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        if self.score_fn not in ("softmax", "sigmoid"):
            raise ValueError(f"MoEArgs.score_fn={self.score_fn!r}; expected softmax or sigmoid")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(
                f"MoEArgs top_k={self.top_k}, n_experts={self.n_experts}; expected "
                "1 <= top_k <= n_experts"
            )
        if self.hidden_dim <= 0 or self.shared_expert_hidden_dim < 0:
            raise ValueError(
                f"MoEArgs hidden_dim={self.hidden_dim}, shared_expert_hidden_dim="
                f"{self.shared_expert_hidden_dim}; expected > 0 and >= 0"
            )


@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """Shape of the transformer; ``ffn_hidden_dim`` is derived Llama-style."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # None: same as n_heads (plain multi-head attention)
    vocab_size: int = 256
    multiple_of: int = 256  # round the SwiGLU hidden dim up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    moe: MoEArgs | None = None  # None: dense SwiGLU feed-forward in every block

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelArgs.{name}={value!r}; expected a positive int")
        if self.dim % self.n_heads != 0 or self.head_dim % 2 != 0:
            raise ValueError(
                f"ModelArgs dim={self.dim}, n_heads={self.n_heads} give head_dim "
                f"{self.dim / self.n_heads}; expected an even integer head_dim (RoPE rotates "
                "pairs); choose dim divisible by 2 * n_heads"
            )
        if self.kv_heads <= 0 or self.n_heads % self.kv_heads != 0:
            raise ValueError(
                f"ModelArgs n_kv_heads={self.n_kv_heads} with n_heads={self.n_heads}; expected "
                "a positive divisor of n_heads (grouped-query attention shares each kv head "
                "among n_heads // n_kv_heads query heads)"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        # Llama: start from 4 * dim, take 2/3 (SwiGLU has three matrices instead of two),
        # apply the optional multiplier, round up to multiple_of.
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


PRESETS: dict[str, ModelArgs] = {
    # ~3.3M parameters, byte-level; every linear dim is a multiple of 16 (float8 GEMMs).
    "tiny": ModelArgs(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=1024),
    # the tiny shape with a MoE feed-forward: 8 experts, top-2, a shared expert (8.0M)
    "moe_tiny": ModelArgs(
        dim=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=1024,
        moe=MoEArgs(n_experts=8, top_k=2, hidden_dim=256, shared_expert_hidden_dim=256),
    ),
    # ~38M parameters, byte-level.
    "small": ModelArgs(dim=512, n_layers=12, n_heads=8, n_kv_heads=4, max_seq_len=2048),
    # Llama-3 shapes (no rope frequency scaling): ffn hidden 14336 and 28672.
    "llama3_8b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    "llama3_70b": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    # GPU shapes. DeepSeek-V3-like (scaled down to a single node: sigmoid router, fine
    # experts, a shared expert): 64 experts top-6, expert hidden 1408, shared 2816.
    "deepseek_v3_like": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=16,
        vocab_size=129280,
        max_seq_len=4096,
        moe=MoEArgs(
            n_experts=64,
            top_k=6,
            hidden_dim=1408,
            score_fn="sigmoid",
            shared_expert_hidden_dim=2816,
        ),
    ),
    # Qwen3-30B-A3B's shape: 128 experts top-8, expert hidden 768, softmax router, GQA.
    "qwen3_moe_like": ModelArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        vocab_size=151936,
        rope_theta=1000000.0,
        max_seq_len=4096,
        moe=MoEArgs(n_experts=128, top_k=8, hidden_dim=768),
    ),
}


def model_args(preset: str, **overrides: object) -> ModelArgs:
    """The named preset with fields replaced, e.g. ``model_args("tiny", n_layers=2)``."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; expected one of {sorted(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(
            f"model_args got unknown override(s) {unknown}; expected fields of ModelArgs: "
            f"{sorted(fields)}"
        )
    return dataclasses.replace(PRESETS[preset], **overrides)


def param_count(args: ModelArgs, *, exclude_embedding: bool = True, active: bool = False) -> int:
    """Parameters of ``Transformer(args)`` from the shapes alone (no model needed).

    With ``exclude_embedding`` the token embedding is left out but the output head is
    counted even when tied, since its matmul runs either way (this is the N of 6N).
    ``active``: a MoE block counts only the ``top_k`` experts a token runs through.
    """
    kv_dim = args.kv_heads * args.head_dim
    attention = 2 * args.dim * args.dim + 2 * args.dim * kv_dim
    mlp = 3 * args.dim * args.ffn_hidden_dim
    if args.moe is not None:
        m = args.moe
        experts = m.top_k if active else m.n_experts
        mlp = 3 * args.dim * (experts * m.hidden_dim + m.shared_expert_hidden_dim)
        mlp += m.n_experts * args.dim  # router
    per_block = attention + mlp + 2 * args.dim
    total = args.n_layers * per_block + args.dim + args.vocab_size * args.dim
    if not exclude_embedding and not args.tie_embeddings:
        total += args.vocab_size * args.dim
    return total


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), the PaLM appendix's
    ``6 * N + 12 * n_layers * dim * seq_len``: N counts the active non-embedding parameters
    (the output head included, even when tied, since its matmul runs); the attention term
    ignores causal masking as that formula does."""
    if seq_len <= 0:
        raise ValueError(f"seq_len={seq_len}; expected a positive int")
    return 6 * param_count(args, active=True) + 12 * args.n_layers * args.dim * seq_len
