"""torchao.float8.distributed_utils: is a tensor already float8?"""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from fsdp_float8.core.float8_tensor import Float8Tensor
from fsdp_float8.float8._absent import TRAINING_TENSOR, module_getattr


def tensor_already_casted_to_fp8(tensor: torch.Tensor) -> bool:
    """True for a `Float8Tensor`, also as a DTensor's local tensor or inside an
    asynchronous collective's result."""
    if isinstance(tensor, DTensor):
        return tensor_already_casted_to_fp8(tensor._local_tensor)
    if isinstance(tensor, AsyncCollectiveTensor):
        return tensor_already_casted_to_fp8(tensor.elem)
    return isinstance(tensor, Float8Tensor)


__getattr__ = module_getattr(__name__, {"Float8TrainingTensor": TRAINING_TENSOR})

__all__ = ["tensor_already_casted_to_fp8"]
