"""What `Float8Linear` checks before its GEMMs run, each refusal with its remedy.

At build: dims the float8 GEMMs can contract. At each forward, in this order: a weight
another library quantized (served by its own GEMM, not cast again), a tensor-parallel
weight (the local tensors the layer runs on), a float8 all-gather layer whose weight lost
its wrapper, and an input that `nn.Linear` would refuse too (not a float, or a dtype other
than the weight's outside autocast). None of them runs inside the autograd function.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fsdp_float8.core.config import Float8LinearConfig
from fsdp_float8.core.config_fields import Float8ConfigError
from fsdp_float8.core.float8_tensor import Float8Tensor
from fsdp_float8.nn.layer import QuantizedLinear
from fsdp_float8.weight_wrappers.base import Float8WeightWrapper


def check_dims(in_features: int, out_features: int, config: Float8LinearConfig) -> None:
    # emulated GEMMs (float32 on the dequantized operands) take any shape; the hardware's
    # torch._scaled_mm needs both dims in multiples of 16
    if config.pad_inner_dim or config.emulate or (in_features % 16 == 0 and out_features % 16 == 0):
        return
    remedy = "set Float8LinearConfig(pad_inner_dim=True) or keep"
    if config.uses_block_scales():  # block recipes refuse pad_inner_dim (config_rules)
        remedy = "block-scaled recipes cannot pad (pad_inner_dim is refused with them): keep"
    raise Float8ConfigError(
        f"Float8Linear({in_features}, {out_features}): float8 GEMMs contract over both dims, "
        f"which must be multiples of 16; {remedy} this layer in high precision (the default "
        "module filter skips it), or use dims that are multiples of 16 (emulate=True runs "
        "any dims, with float32 GEMMs)"
    )


def local_parameters(module: QuantizedLinear, x: torch.Tensor):
    """The local weight and bias of a TP Float8Linear (differentiable: their gradients
    come back as DTensors of the same placements)."""
    weight, bias = module.weight, module.bias
    assert isinstance(weight, DTensor)  # the caller checked
    if module.tensor_parallel is None:
        raise TypeError(
            f"this Float8Linear's weight is a DTensor {weight.placements} but the layer "
            "was not parallelized with fsdp_float8's styles; use "
            "the float8 styles of fsdp_float8.tensor_parallel.styles (Float8ColwiseParallel and "
            "its row-parallel counterpart) in the parallelize_module plan (torch's "
            "ColwiseParallel would run it on DTensors)"
        )
    if isinstance(x, DTensor):
        raise TypeError(
            f"a tensor-parallel Float8Linear got a DTensor input {x.placements}; its style "
            "hands it a local tensor, so call the layer through its module (not .forward)"
        )
    local_bias = bias.to_local() if isinstance(bias, DTensor) else bias
    return weight.to_local(), local_bias


def quantized_elsewhere(weight: torch.Tensor) -> bool:
    """A weight another library replaced by its own tensor subclass (torchao's
    `quantize_(model, Float8WeightOnlyConfig())` after training): that subclass knows its
    GEMM (`F.linear` dispatches to it); casting it to float8 again would be wrong."""
    # (tracing's fake and functional tensors are not wrapper subclasses: they stay here)
    if not is_traceable_wrapper_subclass(weight):
        return False
    return not isinstance(weight, (DTensor, Float8Tensor, Float8WeightWrapper))


def check_input_dtype(x: torch.Tensor) -> None:
    # nn.Linear raises on these; the float8 cast would otherwise truncate (int) or fail late
    if not x.dtype.is_floating_point or x.dtype.itemsize == 1:
        raise TypeError(
            f"Float8Linear input has dtype {x.dtype}; expected a floating-point tensor "
            "(float32, bfloat16, float16 or float64), as nn.Linear needs. Cast it with "
            "x.float() (token ids go through an nn.Embedding first)"
        )


def refuse_dtype_mismatch(x_dtype: torch.dtype, weight_dtype: torch.dtype) -> None:
    # nn.Linear refuses it too; the float8 GEMMs would silently return the input's dtype
    raise TypeError(
        f"Float8Linear input has dtype {x_dtype} but its weight is {weight_dtype}; outside "
        f"autocast both must match, as nn.Linear needs. Cast the input (x.to({weight_dtype})), "
        "run the forward under torch.autocast, or give FSDP2 a MixedPrecisionPolicy("
        "param_dtype=...) that casts the inputs of its modules"
    )


def require_float8_weight(weight) -> None:
    # under FSDP2 the weight is the gathered Float8Tensor; unsharded, the wrapper itself
    if not isinstance(weight, (Float8Tensor, Float8WeightWrapper)):
        raise TypeError(
            f"this Float8Linear has enable_fsdp_float8_all_gather=True but its weight is a "
            f"plain {type(weight).__name__}, which FSDP2 would gather in high precision; "
            "assign weights with load_state_dict (the wrapper is kept) or call "
            "layer.wrap_weight_for_fsdp() after replacing the weight, before fully_shard"
        )
