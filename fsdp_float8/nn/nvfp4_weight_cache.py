"""The weight an `NVFP4Linear` GEMM takes: 16x16 tiles, quantized once per set of values.

Two sources. Under FSDP2 the gathered `NVFP4Weight` already is the tiles (and, on CUDA,
their per-GEMM operands), made once per unshard. An unsharded weight is quantized here and
the result kept, weakly keyed by the weight, from the forward that made it to the first
backward that reads it: a layer called twice in a step quantizes its weight once, and a
write to the weight (a new version of its values) makes the next forward quantize again.
Nothing is kept where no version can be read (inference tensors, inference mode) or while
torch.compile traces (the graph quantizes itself).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from fsdp_float8.core import nvfp4, nvfp4_gemm
from fsdp_float8.core.gemms import Gemm
from fsdp_float8.core.scaling import tensor_amax
from fsdp_float8.formats.operands import GatheredOperands
from fsdp_float8.weight_wrappers.base import Float8WeightWrapper, plain_weight
from fsdp_float8.weight_wrappers.nvfp4 import NVFP4Weight, gemm_operand


@dataclass(eq=False)
class QuantizedWeight:
    """A weight in 16x16 tiles and its CUDA GEMM operands (`weight_wrappers.nvfp4.
    gemm_operand`), built once: per unshard (FSDP2's gathered `NVFP4Weight`), or per version
    of an unsharded weight's values. `operands` None: each GEMM builds its operand itself."""

    record: nvfp4.NVFP4
    operands: GatheredOperands | None
    key: tuple = ()


# an unsharded weight -> its QuantizedWeight for its current values, from a forward to the
# first backward that uses it (a layer called twice in a step quantizes its weight once);
# the forwards' autograd graphs hold it, so no memory outlives the backwards
_UNSHARDED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _values_key(weight: torch.Tensor) -> tuple | None:
    """What identifies the values of an unsharded weight: its storage and version counters
    (a wrapper's writes move its state's generation, not its inner tensor's counter; a
    write through `weight.data` moves neither, as autograd does not see it either).
    None where nothing may be kept: under torch.compile (the graph quantizes), inference
    tensors (no version counter), inference mode (the record would be an inference tensor)."""
    hp = plain_weight(weight)
    if torch.compiler.is_compiling() or hp.is_inference() or torch.is_inference_mode_enabled():
        return None
    generation = weight._state.generation if isinstance(weight, Float8WeightWrapper) else -1
    storage = hp.untyped_storage()._cdata
    return (storage, hp.storage_offset(), tuple(hp.shape), hp._version, generation)


def quantized_weight(weight: torch.Tensor, four_over_six: bool) -> QuantizedWeight:
    """The weight in 16x16 tiles: as FSDP2 gathered it, or quantized here (unsharded) once
    per version of its values."""
    if isinstance(weight, NVFP4Weight):
        # under torch.compile the operands are not part of the traced tensor: each GEMM
        # builds its own, as the graph traces it
        compiling = torch.compiler.is_compiling()
        return QuantizedWeight(weight.record, None if compiling else weight.operands)
    hp = plain_weight(weight)
    key = _values_key(weight)
    key = None if key is None else (*key, four_over_six)
    ref = None if key is None else _UNSHARDED.get(weight)
    found = None if ref is None else ref()
    if found is not None and found.key == key:
        return found
    amax = tensor_amax(hp).reshape(())
    record = nvfp4.quantize(hp, amax, nvfp4.WEIGHT_BLOCK, four_over_six=four_over_six)
    if key is None:
        return QuantizedWeight(record, None)
    found = QuantizedWeight(record, GatheredOperands([]), key)
    _UNSHARDED[weight] = weakref.ref(found)
    return found


def release(weight: torch.Tensor, w: QuantizedWeight) -> None:
    """The first backward that used `w` ends its reuse by later forwards."""
    ref = _UNSHARDED.get(weight)
    if ref is not None and ref() is w:
        del _UNSHARDED[weight]


def weight_operand(w: QuantizedWeight, gemm: Gemm, emulate: bool) -> nvfp4_gemm.GemmOperand | None:
    """The weight's operand of the CUDA FP4 `gemm`, built once (`QuantizedWeight`); None
    where the GEMM takes the record itself: the emulated GEMM (CPU, `emulate`), which
    dequantizes it, and a weight without an operands record (under torch.compile)."""
    if w.operands is None or emulate or w.record.packed.device.type != "cuda":
        return None
    return gemm_operand(w.record, w.operands, gemm)
