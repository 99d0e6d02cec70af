"""Which forwards feed delayed-scaling history: training forwards only. Not a forward under
no_grad / inference_mode / eval() (before the first sync included: such a forward neither
records nor initializes), and not the forward that torch.distributed.pipelining runs, with
gradients enabled, to infer a stage's shapes when it was built without example inputs (a
later stage then computes on uninitialized memory). The 4-rank pipeline runs are in
tests/distributed/test_pipeline_parallel.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from torch.distributed.pipelining.stage import PipelineStage

from fsdp_float8 import CastConfig, Float8LinearConfig, convert_to_float8_training
from fsdp_float8.core.training_forward import is_training_forward, shape_inference_codes

DELAYED = CastConfig(scaling_type="delayed")
CONFIG = Float8LinearConfig(
    cast_config_input=DELAYED, cast_config_weight=DELAYED, cast_config_grad_output=DELAYED
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 32, bias=False))
    return convert_to_float8_training(model, config=CONFIG)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers()}


# pipelining's shape-inference method: torch 2.13+ runs it with gradients enabled on the
# stage's input (uninitialized memory on a later stage), torch 2.11 and 2.12 under no_grad
# on zeros; the library recognises both by name (core.delayed_state)
_METHOD = next(
    name
    for name in ("_forward_metadata_inference", "_shape_inference")
    if hasattr(PipelineStage, name)
)


def test_the_installed_torch_names_its_shape_inference() -> None:
    # a torch that renames pipelining's shape-inference methods fails here, not silently
    names = {code.co_name for code in shape_inference_codes()}
    assert _METHOD in names, (_METHOD, names)


def _run_shape_inference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """pipelining's own shape-inference method, on a stand-in for the stage (first and last
    stage of one, so it needs no process group), with a backward as pipelining runs one."""
    stage = SimpleNamespace(
        is_first=True,
        is_last=True,
        submod=model,
        _stage_meta=SimpleNamespace(inputs=None, outputs=None),
        _forward_contexts={},  # torch 2.15: no forward context registered
        _to_tensor=lambda t: t.detach().requires_grad_(t.requires_grad),
        _compute_outputs=lambda *args, module, **kw: module(*args, **kw),
    )
    if _METHOD == "_forward_metadata_inference":
        PipelineStage._forward_metadata_inference(stage, (x,), has_backward=True)
        (out,) = stage._fwd_outputs_for_bwd_meta
        return out
    # the older method: under no_grad, on zeros of the input's shape, outputs kept as meta
    stage.device, stage.stage_index = x.device, 0
    seen: list[torch.Tensor] = []
    handle = model.register_forward_hook(lambda m, args, out: seen.append(out))
    stage._configure_outputs_meta = lambda meta: None
    try:
        PipelineStage._shape_inference(stage, (x,))
    finally:
        handle.remove()
    (out,) = seen
    return out.detach().requires_grad_()  # what the caller's backward can run on


def test_pipelining_shape_inference_feeds_no_history() -> None:
    model = _model()
    before = _state(model)
    garbage = torch.full((4, 32), 3e26)  # what uninitialized memory can hold
    out = _run_shape_inference(model, garbage)
    out.float().pow(2).mean().backward()  # grad_output casts record nothing either
    for name, buf in model.named_buffers():
        assert torch.equal(buf, before[name]), name
    assert not any(m.delayed_scaling.ready for m in (model[0], model[2]))


def test_shape_inference_is_told_apart_from_the_training_step() -> None:
    model = _model()
    seen = []
    model[0].register_forward_pre_hook(lambda m, args: seen.append(is_training_forward(m)))
    _run_shape_inference(model, torch.randn(4, 32))
    model(torch.randn(4, 32))
    assert seen == [False, True]


def test_no_grad_inference_mode_and_eval_forwards_before_the_first_sync() -> None:
    model = _model()
    before = _state(model)
    x = torch.randn(4, 32) * 1e6
    with torch.no_grad():
        model(x)
    with torch.inference_mode():
        model(x)
    model.eval()
    model(x)
    for name, buf in model.named_buffers():
        assert torch.equal(buf, before[name]), name
