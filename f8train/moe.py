"""The mixture-of-experts feed-forward of ``f8train.model`` (no expert parallelism; docs/api.md).

A float32 router sends each token to its ``top_k`` experts (weights renormalised over the
k); the tokens, sorted by expert, run through ``GroupedExperts`` (torchtitan's layout, which
the float8 conversion swaps for ``Float8GroupedExperts``) and are scattered back; an optional
dense shared expert adds to every token. Each forward keeps ``aux_loss`` (Switch load
balancing ``E * sum_e f_e * p_e``: f the fraction of routed slots, p the mean probability).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_float8.experts.grouped_mm import grouped_mm_hp


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


class GroupedExperts(nn.Module):
    """E SwiGLU experts as 3-D weights; ``forward(x, num_tokens_per_expert)``, x sorted."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(num_tokens_per_expert, 0).to(torch.int32)

        def mm(a, w):
            return grouped_mm_hp(a, w.transpose(-2, -1), offs, a.dtype)

        return mm(F.silu(mm(x, self.w1)) * mm(x, self.w3), self.w2)


class MoE(nn.Module):
    """Routed experts plus an optional dense ``shared_expert`` (built by the caller)."""

    def __init__(self, dim: int, args: MoEArgs, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.args = args
        self.router = nn.Parameter(torch.empty(args.n_experts, dim))
        self.experts = GroupedExperts(dim, args.hidden_dim, args.n_experts)
        self.shared_expert = shared_expert
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        logits = F.linear(x2.float(), self.router.float())  # the router in float32
        probs = logits.softmax(dim=-1) if self.args.score_fn == "softmax" else logits.sigmoid()
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
        self.tokens_per_expert = counts.detach()
        return out.reshape(x.shape)


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Every MoE block's load-balancing loss of the last forward times its ``aux_loss_coef``,
    summed (None for a model without MoE blocks)."""
    losses = [m.args.aux_loss_coef * m.aux_loss for m in model.modules() if isinstance(m, MoE)]
    return torch.stack(losses).sum() if losses else None


def tokens_per_expert(model: nn.Module) -> list[list[int]]:
    """Per MoE block, the routed slots each expert got in the last forward (this rank)."""
    return [m.tokens_per_expert.tolist() for m in model.modules() if isinstance(m, MoE)]


def moe_fields(model: nn.Module) -> dict:
    """This rank's MoE metrics of the last forward ({} without MoE): ``moe_aux_loss`` (as
    added to the loss), ``expert_load_max_over_mean`` (busiest expert over the mean, worst
    block; 1.0 is perfect balance) and ``tokens_per_expert``."""
    blocks = [m for m in model.modules() if isinstance(m, MoE) and m.tokens_per_expert is not None]
    if not blocks:
        return {}
    counts = [m.tokens_per_expert.float() for m in blocks]
    imbalance = max((c.max() / c.mean().clamp(min=1e-9)).item() for c in counts)
    return {
        "moe_aux_loss": moe_aux_loss(model).item(),
        "expert_load_max_over_mean": imbalance,
        "tokens_per_expert": tokens_per_expert(model),
    }
