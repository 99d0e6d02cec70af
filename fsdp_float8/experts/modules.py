"""Float8 expert modules and the expert layouts they replace (the module swap for MoE).

Mental model: an experts module holds 3-D weights `(E, out, in)` (each `weight[e]` an
nn.Linear weight) and runs them on routed tokens. Two layouts are recognised:

- torchtitan-style `GroupedExperts`: `w1`, `w3` `(E, hidden, dim)` and `w2` `(E, dim,
  hidden)`, `forward(x, num_tokens_per_expert)` with the tokens already permuted by expert;
  `out = (silu(x @ w1[e].T) * (x @ w3[e].T)) @ w2[e].T`. This repository's own MoE block
  (`f8train/moe.py`) uses it.
- Hugging Face `transformers` 5.x fused experts (`Qwen3MoeExperts`, `MixtralExperts`, ...):
  `gate_up_proj (E, 2*inter, hidden)`, `down_proj (E, hidden, inter)`, `act_fn`,
  `forward(hidden_states, top_k_index, top_k_weights)` with the tokens in model order.

`plan_expert_swap` says for a module whether it is an experts module, and either the float8
module that replaces it (sharing its parameters) or why it is skipped. The float8 modules
permute tokens by expert where needed and run `fsdp_float8.experts.gemm.float8_grouped_mm`; with
`enable_fsdp_float8_all_gather` their 3-D weights become float8 weight wrappers, so FSDP2
gathers them in float8 (1 byte per element plus per-row scales for rowwise).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_float8.core._compat import probe_device
from fsdp_float8.core.config import Float8LinearConfig
from fsdp_float8.experts.gemm import ExpertCastPlan, check_expert_config, float8_grouped_mm
from fsdp_float8.weight_wrappers.base import Float8WeightWrapper, state_dict_weight
from fsdp_float8.weight_wrappers.wrap import wrap_weight

_TITAN = ("w1", "w2", "w3")
_FUSED = ("gate_up_proj", "down_proj")


def expert_layout(module: nn.Module) -> str | None:
    """'grouped' (w1/w2/w3), 'fused' (gate_up_proj/down_proj), or None (not experts)."""
    if isinstance(module, Float8ExpertsBase):
        return module.layout
    for layout, names in (("grouped", _TITAN), ("fused", _FUSED)):
        params = [getattr(module, n, None) for n in names]
        if all(isinstance(p, nn.Parameter) and p.dim() == 3 for p in params):
            return layout
    return None


def has_3d_parameters(module: nn.Module) -> bool:
    return any(p.dim() == 3 for p in module.parameters(recurse=False))


def skip_reason(module: nn.Module, config: Float8LinearConfig) -> str | None:
    """Why this experts module stays in high precision, or None to convert it."""
    layout = expert_layout(module)
    if layout is None:
        names = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
        return (
            f"3-D parameters {names} in no known expert layout (w1/w2/w3 as torchtitan's "
            "GroupedExperts, or gate_up_proj/down_proj as transformers' fused experts)"
        )
    if isinstance(module, Float8ExpertsBase):
        return "already float8 experts"
    if layout == "fused" and (why := _fused_layout_problem(module)):
        return why
    if layout == "fused":
        flags = {"has_bias": False, "is_transposed": False, "has_gate": True}
        flags["is_concatenated"] = True
        off = {k: getattr(module, k) for k, v in flags.items() if getattr(module, k, v) != v}
        if off or not hasattr(module, "act_fn"):
            return f"transformers experts with {off or 'no act_fn'}: only the concatenated [gate; up] layout (E, out, in) without biases is supported"
    if isinstance(config, Float8LinearConfig):
        try:
            check_expert_config(config)
        except ValueError as e:
            return str(e)
    dims = _weight_dims(module, layout)
    if not config.pad_inner_dim and any(d % 16 for d in dims):
        hint = (
            "block recipes cannot pad"
            if config.uses_block_scales()
            else "set pad_inner_dim=True to pad"
        )
        return f"expert dims {dims} not multiples of 16 ({hint})"
    return None


def _fused_layout_problem(module: nn.Module) -> str | None:
    """Why a gate_up_proj/down_proj module is not transformers 5.x's fused experts layout
    (None: it is): `gate_up_proj (E, 2*inter, hidden)`, `down_proj (E, hidden, inter)` and
    `forward(hidden_states, top_k_index, top_k_weights)`. Llama4TextExperts, for one, holds
    them transposed, (E, in, out), and takes tokens already grouped by expert."""
    name = type(module).__name__
    gate_up = module.get_parameter("gate_up_proj").shape
    down = module.get_parameter("down_proj").shape
    if gate_up[1] != 2 * down[2] or gate_up[2] != down[1]:
        return (
            f"{name} holds gate_up_proj {tuple(gate_up)} and down_proj {tuple(down)}, not the "
            "fused layout (E, 2*inter, hidden) / (E, hidden, inter) (transposed weights, "
            "(E, in, out), as Llama4TextExperts: not supported)"
        )
    params = inspect.signature(module.forward).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in params if p.kind in kinds]
    if len(names) < 3 and not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return (
            f"{name}.forward({', '.join(names)}) is not the fused experts' forward("
            "hidden_states, top_k_index, top_k_weights): not supported"
        )
    return None


def _weight_dims(module: nn.Module, layout: str) -> tuple[int, ...]:
    names = _TITAN if layout == "grouped" else _FUSED
    return tuple(sorted({d for n in names for d in getattr(module, n).shape[1:]}))


def converts_experts(config: object) -> bool:
    """Whether `config` converts experts modules: a Float8LinearConfig, or a format's layer
    config naming its experts classes (`experts_classes`: layout -> class)."""
    return isinstance(config, Float8LinearConfig) or hasattr(config, "experts_classes")


def to_float8_experts(module: nn.Module, config: Float8LinearConfig) -> Float8ExpertsBase:
    """The float8 module for an experts module `skip_reason` accepted (parameters shared):
    a format's own experts class where its config names one for the layout."""
    layout = expert_layout(module)
    classes = getattr(config, "experts_classes", None)
    if classes is not None:
        return classes[layout].from_experts(module, config)
    cls = Float8GroupedExperts if layout == "grouped" else Float8FusedExperts
    return cls.from_experts(module, config)


class Float8ExpertsBase(nn.Module):
    layout: str
    weight_names: tuple[str, ...]

    @property
    def float8_weight_names(self) -> tuple[str, ...]:
        """What the float8 step asks (`fsdp_float8.fsdp.refresh.Float8Module`)."""
        return self.weight_names

    def _setup(self, source: nn.Module, config: Float8LinearConfig) -> None:
        self.config = config
        self.plan = ExpertCastPlan.from_config(config)
        for name in self.weight_names:
            setattr(self, name, getattr(source, name))  # shared, not copied
        self.num_experts = getattr(source, self.weight_names[0]).shape[0]
        probe_device(getattr(source, self.weight_names[0]).device)  # not first in a forward
        # as Float8Linear: checkpoints hold plain tensors; a load (assign=True) re-wraps
        self._register_state_dict_hook(_plain_weights_in_state_dict)
        self.register_load_state_dict_post_hook(lambda m, keys: m.wrap_weights_for_fsdp())
        self.wrap_weights_for_fsdp()

    def wrap_weights_for_fsdp(self) -> None:
        """With `enable_fsdp_float8_all_gather`, each 3-D weight becomes a float8 weight
        wrapper (idempotent; the storage is shared)."""
        if not self.config.enable_fsdp_float8_all_gather:
            return
        for name in self.weight_names:
            p = getattr(self, name)
            if isinstance(p, DTensor):  # sharded by FSDP2 (a load's post hook): its local part
                if not isinstance(p._local_tensor, Float8WeightWrapper):
                    p._local_tensor = wrap_weight(p._local_tensor, self, name).data
            elif not isinstance(p, Float8WeightWrapper):
                setattr(self, name, wrap_weight(p, self, name))

    def grouped(self, x: torch.Tensor, name: str, offs: torch.Tensor) -> torch.Tensor:
        return float8_grouped_mm(x, getattr(self, name), offs, self.plan)

    def extra_repr(self) -> str:
        shapes = ", ".join(f"{n}={tuple(getattr(self, n).shape)}" for n in self.weight_names)
        return f"{shapes}, fsdp_float8_all_gather={self.config.enable_fsdp_float8_all_gather}"


def _plain_weights_in_state_dict(module, state_dict, prefix, local_metadata) -> None:
    for name in module.weight_names:
        key = prefix + name
        if key in state_dict:
            weight = getattr(module, name)
            state_dict[key] = state_dict_weight(weight, detach=state_dict[key] is not weight)


class Float8GroupedExperts(Float8ExpertsBase):
    """torchtitan-style experts in float8: `forward(x, num_tokens_per_expert)`, x permuted."""

    layout = "grouped"
    weight_names = _TITAN

    @classmethod
    def from_experts(cls, source: nn.Module, config: Float8LinearConfig):
        new = cls()
        new._setup(source, config)
        return new

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(num_tokens_per_expert, 0).to(torch.int32)
        h = F.silu(self.grouped(x, "w1", offs)) * self.grouped(x, "w3", offs)
        return self.grouped(h, "w2", offs)


class Float8FusedExperts(Float8ExpertsBase):
    """transformers fused experts in float8: the same forward signature, tokens in model
    order; routed copies of the tokens are sorted by expert and weighted back."""

    layout = "fused"
    weight_names = _FUSED
    act_fn: Callable[[torch.Tensor], torch.Tensor]  # the source module's activation

    @classmethod
    def from_experts(cls, source: nn.Module, config: Float8LinearConfig):
        new = cls()
        new.act_fn = cast(Callable[[torch.Tensor], torch.Tensor], source.act_fn)
        new._setup(source, config)
        return new

    def forward(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        x, offs, token_of, order = permute_by_expert(hidden_states, top_k_index, self.num_experts)
        gate, up = self.grouped(x, "gate_up_proj", offs).chunk(2, dim=-1)
        y = self.grouped(self.act_fn(gate) * up, "down_proj", offs)
        y = y * top_k_weights.reshape(-1)[order, None]
        out = torch.zeros_like(hidden_states)
        return out.index_add_(0, token_of, y.to(out.dtype))


def permute_by_expert(hidden: torch.Tensor, top_k_index: torch.Tensor, num_experts: int):
    """Copies of the tokens sorted by expert: (x, offs, token of each row, sort order).
    Index `num_experts` (transformers' marker for a slot not routed here) is dropped."""
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)  # raises on a negative index
    if counts.numel() > num_experts + 1:  # its length is the largest index + 1: no extra sync
        raise ValueError(
            f"top_k_index holds expert {counts.numel() - 1}, but this experts module has "
            f"{num_experts} experts (0..{num_experts - 1}; {num_experts} marks a slot routed "
            "to no local expert); check the router's number of experts and top_k_index"
        )
    counts = counts[:num_experts]
    offs = torch.cumsum(counts, 0).to(torch.int32)
    routed = int(offs[-1])  # host copy: rows past it were routed to no local expert
    order = order[:routed]
    token_of = order // top_k_index.shape[-1]
    return hidden[token_of], offs, token_of, order
