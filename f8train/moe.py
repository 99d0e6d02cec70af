"""The mixture-of-experts feed-forward of `f8train.model` (a block's `feed_forward` when
`ModelArgs.moe` is set).

Mental model (DeepSeek-V3 / Qwen3-MoE style, no expert parallelism):

    scores = router(x)                      # float32 logits (n_experts,), softmax or sigmoid
    top_k_weights, top_k_index = topk(scores, k)   (renormalised over the k chosen)
    tokens sorted by expert -> experts(x_sorted, tokens_per_expert) -> weighted, scattered back
    out = routed + shared_expert(x)         # optional dense SwiGLU expert

`GroupedExperts` is the torchtitan layout: `w1`, `w3` `(E, hidden, dim)`, `w2` `(E, dim,
hidden)`, each `w[e]` an nn.Linear weight; `convert_to_float8_training` swaps it for
`fsdp_float8.experts.modules.Float8GroupedExperts`. The router is not an nn.Linear (a plain
parameter used in float32), so it always stays in high precision. After each forward the
block keeps `aux_loss` (the Switch load-balancing loss `E * sum_e f_e * p_e`, f the fraction
of routed slots and p the mean router probability of expert e) and `tokens_per_expert`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from f8train.model_shapes import MoEArgs
from fsdp_float8.experts.grouped_mm import grouped_mm_hp


class GroupedExperts(nn.Module):
    """E SwiGLU experts as 3-D weights; `forward(x, num_tokens_per_expert)`, x sorted."""

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
    """Routed experts plus an optional dense `shared_expert` (the caller builds it, with
    `args.shared_expert_hidden_dim`), both applied to every token."""

    def __init__(self, dim: int, args: MoEArgs, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.args = args
        self.router = nn.Parameter(torch.empty(args.n_experts, dim))
        self.experts = GroupedExperts(dim, args.hidden_dim, args.n_experts)
        self.shared_expert = shared_expert
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None

    def route(self, x2: torch.Tensor):
        """(top_k_weights, top_k_index, probs) in float32 (the router in high precision)."""
        logits = F.linear(x2.float(), self.router.float())
        if self.args.score_fn == "softmax":
            probs = logits.softmax(dim=-1)
        else:
            probs = logits.sigmoid()
        top_w, top_i = probs.topk(self.args.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_w, top_i, probs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        top_w, top_i, probs = self.route(x2)
        flat = top_i.reshape(-1)
        counts = torch.bincount(flat, minlength=self.args.n_experts)
        order = torch.argsort(flat, stable=True)
        token_of = order // self.args.top_k
        y = self.experts(x2[token_of], counts)
        y = y * top_w.reshape(-1)[order, None].to(y.dtype)
        out = torch.zeros_like(x2).index_add_(0, token_of, y.to(x2.dtype))
        if self.shared_expert is not None:
            out = out + self.shared_expert(x2)
        self.aux_loss = self._load_balancing_loss(counts, probs)
        self.tokens_per_expert = counts.detach()
        return out.reshape(x.shape)

    def _load_balancing_loss(self, counts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        fraction = counts.float() / counts.sum().clamp(min=1)
        mean_prob = (probs / probs.sum(dim=-1, keepdim=True)).mean(dim=0)
        return self.args.n_experts * (fraction * mean_prob).sum()


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of every MoE block's load-balancing loss of the last forward, each times its
    `aux_loss_coef` (None for a model without MoE blocks)."""
    losses = [m.args.aux_loss_coef * m.aux_loss for m in model.modules() if isinstance(m, MoE)]
    return torch.stack(losses).sum() if losses else None


def tokens_per_expert(model: nn.Module) -> list[list[int]]:
    """Per MoE block, the routed slots each expert got in the last forward (this rank)."""
    return [m.tokens_per_expert.tolist() for m in model.modules() if isinstance(m, MoE)]


def moe_fields(model: nn.Module) -> dict:
    """Metrics of the last forward for a MoE model ({} otherwise), this rank's tokens:
    `moe_aux_loss` (weighted, as added to the loss), `expert_load_max_over_mean` (the
    busiest expert's routed slots over the mean, worst block; 1.0 is perfect balance) and
    `tokens_per_expert` (per block)."""
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
