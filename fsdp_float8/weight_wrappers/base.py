"""Weight wrapper mechanics, once: a high-precision weight that FSDP2 all-gathers in float8.

A `Float8WeightWrapper` holds the high-precision weight (`_tensor`) and looks like it to
everyone (dtype, shape). Ops unwrap to the inner tensor; the ops FSDP2 uses to build and
pad shards (`PRESERVE_WRAPPER`) keep the wrapper, so the sharded parameter's local tensor
still has the hooks. In-place ops mutate the inner tensor and return the wrapper.

FSDP2 hooks (torch 2.13 signatures):
- `fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)`: cast the local
  shard to float8 with `float8_scale(...)` (the only thing subclasses decide), pad it to the
  padded shard size (uneven sharding), return it as a `uint8` view (gloo rejects float8; one
  code path for NCCL too) and `(scale, float8_dtype, emulate)` as metadata.
- `fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)`: view the gathered
  bytes as float8 and return a `Float8Tensor`; later calls refill `out` in place (its data
  already aliases the all-gather output) and only refresh its scale.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves, tree_map_only

from fsdp_float8.config import Float8LinearConfig, Gemm, Operand, ScalingGranularity
from fsdp_float8.float8_tensor import Float8Tensor
from fsdp_float8.scaling import cast_to_float8_data

aten = torch.ops.aten
PRESERVE_WRAPPER = {
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.slice.Tensor,
    aten.copy_.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.as_strided.default,
    aten._to_copy.default,
    aten._pin_memory.default,
    aten.split.Tensor,
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
}


class Float8WeightWrapper(torch.Tensor):
    _tensor: torch.Tensor
    _config: Float8LinearConfig

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, config: Float8LinearConfig):
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )
        self._tensor = tensor
        self._config = config
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._tensor!r})"

    def __tensor_flatten__(self):
        return ["_tensor"], self._config

    @classmethod
    def __tensor_unflatten__(cls, inner, config, outer_size, outer_stride):
        return cls(inner["_tensor"], config)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        wrappers = [a for a in _flat(args, kwargs) if isinstance(a, Float8WeightWrapper)]
        first = wrappers[0]
        unwrapped = tree_map_only(Float8WeightWrapper, lambda w: w._tensor, (args, kwargs))
        out = func(*unwrapped[0], **unwrapped[1])
        if func in PRESERVE_WRAPPER:
            return tree_map_only(torch.Tensor, lambda t: first._rewrap(t), out)
        inner_to_wrapper = {id(w._tensor): w for w in wrappers}
        return tree_map_only(torch.Tensor, lambda t: inner_to_wrapper.get(id(t), t), out)

    def _rewrap(self, tensor: torch.Tensor):
        new = type(self)(tensor, self._config)
        self._copy_state_to(new)
        return new

    def _copy_state_to(self, new: Float8WeightWrapper) -> None:
        """Subclasses carry extra state (e.g. a precomputed scale) through FSDP2's ops."""

    # -- what subclasses decide -------------------------------------------------------
    def float8_scale(self, mesh, module) -> torch.Tensor:
        raise NotImplementedError

    # -- FSDP2 hooks ------------------------------------------------------------------
    @property
    def float8_dtype(self) -> torch.dtype:
        return self._config.float8_dtype(Operand.WEIGHT, Gemm.OUTPUT)

    @property
    def rowwise(self) -> bool:
        """Per-output-row scales: local to each dim-0 shard, gathered with the data."""
        cfg = self._config.cast(Operand.WEIGHT, Gemm.OUTPUT)
        return cfg.scaling_granularity is ScalingGranularity.AXISWISE

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        scale = self.float8_scale(mesh, module)
        data = cast_to_float8_data(self._tensor, scale, self.float8_dtype).view(torch.uint8)
        padded_rows = math.ceil(outer_size[0] / mesh.size())
        if self.rowwise:
            if outer_size[0] % mesh.size() != 0:  # every rank sees this: no rank hangs
                raise ValueError(
                    f"rowwise float8 all-gather of a weight with {outer_size[0]} rows over "
                    f"{mesh.size()} shards: FSDP2 needs every all-gather input at the padded "
                    "shard size, which the row scales cannot have; use rows divisible by the "
                    "shard count, the 'tensorwise' recipe, or enable_fsdp_float8_all_gather=False"
                )
            return (data, scale), (None, self.float8_dtype, self._config.emulate)
        if data.shape[0] < padded_rows:  # uneven sharding: every rank sends the padded size
            data = F.pad(data, (0, 0, 0, padded_rows - data.shape[0]))
        return (data,), (scale, self.float8_dtype, self._config.emulate)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        gathered_scale, float8_dtype, emulate = metadata
        data = all_gather_outputs[0].view(float8_dtype)
        if len(all_gather_outputs) == 2:  # rowwise: the scales arrived with the data
            scale = all_gather_outputs[1]
            if out is not None:
                return  # data and scales alias the all-gather outputs that FSDP2 refilled
            return Float8Tensor(data, scale, param_dtype, emulate), (data, scale)
        if out is not None:
            if not isinstance(out, Float8Tensor):
                raise TypeError(f"expected the unsharded Float8Tensor as out, got {type(out)}")
            out._scale.copy_(gathered_scale)
            return
        return Float8Tensor(data, gathered_scale.clone(), param_dtype, emulate), (data,)


def _flat(args, kwargs):
    return tree_leaves((args, kwargs))


def plain_weight(t: torch.Tensor) -> torch.Tensor:
    """The high-precision weight without the wrapper (a DTensor keeps its sharding), so
    checkpoints hold plain tensors and load anywhere, with or without this package."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor) and isinstance(t._local_tensor, Float8WeightWrapper):
        return DTensor.from_local(
            t._local_tensor._tensor,
            t.device_mesh,
            t.placements,
            run_check=False,
            shape=t.shape,
            stride=t.stride(),
        )
    return t._tensor if isinstance(t, Float8WeightWrapper) else t
