"""Checkpoints written by torchao.float8 load here, in a process that never imports torchao.

Where torchao's float8 all-gather is on, each float8 weight is a tensor subclass,
`torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor`, and checkpoints pickle it:
a `torch.save`d state dict, and every tensor item of a DCP checkpoint (the `.distcp`
files; `.metadata` names no torchao class). Unpickling with `weights_only=True` (DCP's
reader always, `torch.load` by default) finds classes by their qualified names in torch's
safe globals, and fails on torchao's without torchao.

`import fsdp_float8` registers stand-ins under torchao's names (`register_torchao_globals`):
- `TorchaoFloat8Weight` for the weight class: a wrapper holding what torchao pickled
  (`_tensor`, the high-precision values; `_linear_mm_config`, `_dtype`,
  `_precomputed_scale`). Every op on it runs on `_tensor` and returns plain tensors, so
  DCP's `target.copy_(item)` and `load_state_dict` copy the saved values exactly, and a
  converted model computes its own scales from them at its next forward. Saved again, it
  pickles as its plain `_tensor`.
- `ScaledMMConfig` / `LinearMMConfig` (torchao's fields and defaults, from
  `fsdp_float8.float8.float8_training_tensor`) for the configs pickled inside it.

Resuming a torchao run: build the model, convert it with fsdp_float8, `fully_shard` it
and build the optimizer as the torchao run did, then `dcp.load` the state dicts of
`get_state_dict(model, optimizer)` and `set_state_dict` them (docs/torchao.md). A
`torch.load`ed state dict goes into `model.load_state_dict` as it is; `plain_state_dict`
unwraps the stand-ins for code that reads the tensors itself.

In a process that imports torchao too and registers torchao's own class as a safe global,
torch picks either registration for that name; both load the same values through DCP and
`load_state_dict`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from fsdp_float8.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

_TORCHAO = "torchao.float8"


class TorchaoFloat8Weight(torch.Tensor):
    """A torchao float8 weight as unpickled here: its high-precision `_tensor` in a wrapper
    whose every op unwraps it (the results are plain tensors)."""

    _tensor: torch.Tensor

    @staticmethod
    def __new__(cls, tensor: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map_only(cls, lambda w: w._tensor, (args, kwargs or {}))
        return func(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        return self._tensor.detach().__reduce_ex__(protocol)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"TorchaoFloat8Weight({self._tensor!r})"


def register_torchao_globals() -> None:
    """Let `weights_only` unpickling map torchao.float8's checkpoint classes to the stand-ins
    (idempotent; `import fsdp_float8` calls it)."""
    torch.serialization.add_safe_globals(
        [
            (TorchaoFloat8Weight, f"{_TORCHAO}.fsdp_utils.WeightWithDynamicFloat8CastTensor"),
            (ScaledMMConfig, f"{_TORCHAO}.float8_training_tensor.ScaledMMConfig"),
            (LinearMMConfig, f"{_TORCHAO}.float8_training_tensor.LinearMMConfig"),
        ]
    )


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` without a torchao stand-in, as a plain tensor sharing its storage (torchao keeps
    an `nn.Parameter` inside; a DTensor keeps its sharding); other tensors as they are."""
    if isinstance(t, DTensor) and isinstance(t._local_tensor, TorchaoFloat8Weight):
        local = t._local_tensor._tensor.detach()
        return DTensor.from_local(
            local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    return t._tensor.detach() if isinstance(t, TorchaoFloat8Weight) else t


def plain_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of `state_dict` (nested dicts and lists too) with every torchao stand-in
    replaced by its high-precision tensor."""
    return tree_map_only(torch.Tensor, plain_tensor, state_dict)


__all__ = ["TorchaoFloat8Weight", "plain_state_dict", "plain_tensor", "register_torchao_globals"]

register_torchao_globals()
