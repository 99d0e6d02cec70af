"""Which forwards are training steps': the ones whose amaxes feed delayed scaling's history.

A forward counts when its module is in train mode with gradients enabled, except the one
torch.distributed.pipelining runs before the first step to infer its stages' shapes (for
stages built without example inputs): that forward looks like training (gradients on, a
backward after it) but a later stage's input is uninitialized memory. It is recognised by
pipelining's shape-inference methods on the Python stack; a compiled graph has no stack to
look at and counts as training.
"""

from __future__ import annotations

import sys

import torch
from torch import nn


def is_training_forward(module: nn.Module) -> bool:
    """Whether a forward of `module` now is a training step's, whose amaxes feed the delayed
    history: the module in train mode, gradients enabled, and not a forward that
    torch.distributed.pipelining runs before the first step to infer the stages' shapes
    (stages built without example inputs; a later stage's input is then uninitialized
    memory, under `enable_grad`, with a backward after it)."""
    if not (module.training and torch.is_grad_enabled()):
        return False
    if torch.compiler.is_compiling():  # a traced graph has no Python stack to look at
        return True
    return not in_pipeline_shape_inference()


# pipelining's shape-inference methods, by name across torch versions (2.13: the first)
_SHAPE_INFERENCE_METHODS = ("_forward_metadata_inference", "_shape_inference")
_inference_codes: dict[int, frozenset] = {}  # id(pipelining's stage module) -> code objects


def shape_inference_codes() -> frozenset:
    """The code objects of pipelining's shape-inference methods (empty when
    torch.distributed.pipelining was never imported: then nothing runs them)."""
    stage = sys.modules.get("torch.distributed.pipelining.stage")
    if stage is None:
        return frozenset()
    codes = _inference_codes.get(id(stage))
    if codes is None:
        found = set()
        for cls in vars(stage).values():
            for name in _SHAPE_INFERENCE_METHODS:
                fn = vars(cls).get(name) if isinstance(cls, type) else None
                if fn is not None and hasattr(fn, "__code__"):
                    found.add(fn.__code__)
        codes = _inference_codes[id(stage)] = frozenset(found)
    return codes


def in_pipeline_shape_inference() -> bool:
    """Whether pipelining's shape inference is on the Python stack (a few microseconds,
    and only once pipelining was imported)."""
    codes = shape_inference_codes()
    frame = sys._getframe(1) if codes else None
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False
