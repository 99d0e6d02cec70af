"""Model shapes: `ModelArgs` (the transformer's shape, FFN width derived Llama-style), the
named presets (`PRESETS`, CPU-sized and GPU-sized dense and MoE models) and `model_args`,
a preset with fields replaced. The modules that use them live in `scripts.model`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from scripts.moe import MoEArgs

__all__ = ["PRESETS", "ModelArgs", "model_args"]


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
