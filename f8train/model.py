"""The Llama-style decoder-only transformer that float8 training runs on.

``tokens -> tok_embeddings -> blocks -> norm -> output``; each block is pre-norm residual:
attention (q/k/v/o linears, RoPE, GQA, causal SDPA), then a SwiGLU ``FeedForward`` or an
``f8train.moe.MoE``. Every matmul is a bias-free ``nn.Linear`` (what the float8 conversion
swaps); ``blocks`` is an ``nn.ModuleList`` so FSDP2 shards each block. Build anywhere (meta
included), then ``init_weights(seed)``: each parameter is drawn from a generator seeded by
(seed, its name), so every rank, device and sharding layout gets the same values.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from f8train.moe import MoE, MoEArgs


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
        # Llama: 2/3 of 4 * dim (SwiGLU has three matrices), times the optional multiplier,
        # rounded up to multiple_of
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


_TINY = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=1024)
_LLAMA3 = dict(
    n_kv_heads=8, vocab_size=128256, ffn_dim_multiplier=1.3, rope_theta=500000.0, max_seq_len=8192
)
_GPU_MOE = dict(dim=2048, max_seq_len=4096)
_DEEPSEEK = dict(
    n_experts=64, top_k=6, hidden_dim=1408, score_fn="sigmoid", shared_expert_hidden_dim=2816
)
_QWEN3 = dict(n_layers=48, n_heads=32, n_kv_heads=4, vocab_size=151936, rope_theta=1e6)
PRESETS: dict[str, ModelArgs] = {
    # ~3.3M parameters, byte-level; every linear dim is a multiple of 16 (float8 GEMMs)
    "tiny": ModelArgs(**_TINY),
    # tiny with a MoE feed-forward: 8 experts top-2 and a shared expert (8.0M)
    "moe_tiny": ModelArgs(
        **_TINY, moe=MoEArgs(n_experts=8, top_k=2, hidden_dim=256, shared_expert_hidden_dim=256)
    ),
    "small": ModelArgs(dim=512, n_layers=12, n_heads=8, n_kv_heads=4),  # ~38M, byte-level
    # Llama-3 shapes (no rope frequency scaling): ffn hidden 14336 and 28672
    "llama3_8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, multiple_of=1024, **_LLAMA3),
    "llama3_70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, multiple_of=4096, **_LLAMA3),
    # DeepSeek-V3-like on one node: sigmoid router, 64 fine experts top-6, a shared expert
    "deepseek_v3_like": ModelArgs(
        **_GPU_MOE, n_layers=16, n_heads=16, vocab_size=129280, moe=MoEArgs(**_DEEPSEEK)
    ),
    # Qwen3-30B-A3B's shape: 128 experts top-8, expert hidden 768, softmax router, GQA
    "qwen3_moe_like": ModelArgs(
        **_GPU_MOE, **_QWEN3, moe=MoEArgs(n_experts=128, top_k=8, hidden_dim=768)
    ),
}


def model_args(preset: str, **overrides: object) -> ModelArgs:
    """The named preset with fields replaced, e.g. ``model_args("tiny", n_layers=2)``."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; expected one of {sorted(PRESETS)}")
    fields = sorted(f.name for f in dataclasses.fields(ModelArgs))
    if unknown := sorted(set(overrides) - set(fields)):
        raise TypeError(
            f"model_args got unknown override(s) {unknown}; expected fields of ModelArgs: {fields}"
        )
    return dataclasses.replace(PRESETS[preset], **overrides)


def build_args(flags) -> ModelArgs:
    """The shape the trainer's flags ask for: ``--preset`` with ``--dim``, ``--n-layers``,
    ... replaced and ``max_seq_len`` = ``--seq-len``."""
    names = ("dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of")
    overrides = {k: getattr(flags, k) for k in names if getattr(flags, k) is not None}
    return model_args(flags.preset, max_seq_len=flags.seq_len, **overrides)


def param_count(args: ModelArgs, *, exclude_embedding: bool = True, active: bool = False) -> int:
    """Parameters of ``Transformer(args)``, counted on the meta device. ``exclude_embedding``
    leaves out the token embedding but counts the output head even when tied (its matmul
    runs: the N of 6N); ``active`` counts only the ``top_k`` experts a token runs through."""
    with torch.device("meta"):
        untied = Transformer(dataclasses.replace(args, tie_embeddings=False))
    total = num_params(untied, exclude_embedding=exclude_embedding or args.tie_embeddings)
    if active and (moe := args.moe) is not None:
        total -= args.n_layers * (moe.n_experts - moe.top_k) * 3 * args.dim * moe.hidden_dim
    return total


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token, the PaLM appendix's ``6 N + 12 n_layers dim seq_len`` (N:
    active non-embedding parameters, head included; attention ignores causal masking)."""
    if seq_len <= 0:
        raise ValueError(f"seq_len={seq_len}; expected a positive int")
    return 6 * param_count(args, active=True) + 12 * args.n_layers * args.dim * seq_len


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, normalized in float32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).type_as(x) * self.weight


def rope_tables(args: ModelArgs, device=None) -> tuple[torch.Tensor, torch.Tensor]:
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
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # broadcast over batch, heads
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        # the head counts follow from the linears' widths (a tensor-parallel shard holds
        # 1/tp of them); each kv head serves `repeats` consecutive query heads
        self.head_dim, self.repeats = args.head_dim, args.n_heads // args.kv_heads
        kv_dim = args.kv_heads * args.head_dim
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, kv_dim, bias=False)
        self.wv = nn.Linear(args.dim, kv_dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = (w(x).unflatten(-1, (-1, self.head_dim)) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        if self.repeats > 1:
            k = k.repeat_interleave(self.repeats, dim=1)
            v = v.repeat_interleave(self.repeats, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1(x)) * w3(x))`` (w1 gate, w3 up, w2 down)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

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
    """Decoder-only LM; call ``init_weights(seed)`` after building. ``forward`` returns
    logits in the head's compute dtype (the param dtype under mixed precision)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.blocks = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # non-persistent: init_weights recomputes them (to_empty leaves garbage)
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
            for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
                name = name.replace(wrapper, "")  # torch.compile, activation checkpointing
            full = _initial_value(name, tuple(param.shape), self.args, seed)
            if isinstance(param, DTensor):  # each rank slices its shard, no communication
                full = distribute_tensor(
                    full.to(param.device), param.device_mesh, param.placements, src_data_rank=None
                ).to_local()
                param = param.to_local()
            param.copy_(full)
        self.rope_cos, self.rope_sin = rope_tables(self.args, self.rope_cos.device)


def _initial_value(name: str, shape: tuple[int, ...], args: ModelArgs, seed: int) -> torch.Tensor:
    """The float32 CPU init of parameter ``name``; depends only on (seed, name, shape)."""
    # modulo 2**64, what a torch generator takes: every --seed (0 .. 2**64 - 1) works
    generator = torch.Generator().manual_seed(
        (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**64
    )
    if len(shape) == 1:  # RMSNorm weights
        return torch.ones(shape)
    if name == "tok_embeddings.weight":  # tied, it is also the head: small std keeps logits O(1)
        std = 0.02 if args.tie_embeddings else 1.0
        return torch.empty(shape).normal_(0.0, std, generator=generator)
    std = 0.02
    if name == "output.weight":
        std = args.dim**-0.5
    elif name.endswith((".wo.weight", ".w2.weight", ".experts.w2")):  # residual writers
        std = 0.02 / math.sqrt(2 * args.n_layers)
    # N(0, std^2) truncated to +-3 std by redrawing from normal_, which gives the same values
    # on torch 2.11 to 2.15 (nn.init.trunc_normal_ changed after 2.11; test_model.py pins it)
    z = torch.empty(shape).normal_(generator=generator)
    while (outside := z.abs() > 3).any():
        z[outside] = torch.empty(int(outside.sum())).normal_(generator=generator)
    return z * std


def num_params(model: nn.Module, exclude_embedding: bool = True) -> int:
    """Distinct parameters (global sizes for DTensors), minus the embedding (for a tied model
    that is the head too; ``param_count`` is the one for FLOPs)."""
    total = sum(p.numel() for p in model.parameters())  # parameters() is deduplicated
    if exclude_embedding:
        embeddings = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
        total -= sum({id(w): w.numel() for w in embeddings}.values())
    return total
