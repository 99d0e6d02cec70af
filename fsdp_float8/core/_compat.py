"""What the installed torch can do: the one place that probes torch features (2.11 to 2.15).

Mental model: the package supports a range of torch releases by asking torch, never by
reading its version. Each difference that matters gets one small function here; callers
ask the function and do not probe torch themselves. A probe that costs a call runs once
and is cached: the CPU probes at import, a device's probe when a module is built on it
(`probe_device`), never first inside a forward (selective activation checkpointing replays
a forward's ops by position, so a probe's ops in the first forward break its recompute).

The differences (checked on CPU with torch 2.11.0, 2.13.0 and 2.15.0):
- CPU ``torch._scaled_mm`` takes row scales ((M, 1) and (1, N)) from 2.13; 2.11 takes only
  0-d scales (an internal assert otherwise): ``cpu_scaled_mm_takes_row_scales``.
- ``dist.ReduceOp.PREMUL_SUM(factor)`` is callable and the op has a readable ``.factor``
  from 2.13; 2.11's FSDP2 builds the op with ``dist._make_nccl_premul_sum`` and its factor
  cannot be read back: ``premul_sum`` / ``premul_sum_factor``.
- ``dist.all_gather_single`` / ``dist.reduce_scatter_single`` exist from 2.13; 2.11 has
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (what its FSDP2 calls). Both reach
  the same dispatcher ops (``c10d::_allgather_base_``, ``c10d::_reduce_scatter_base_``),
  so ``comm_stats`` counts either: ``all_gather_single`` / ``reduce_scatter_single``.
- ``torch._grouped_mm`` (2-D x 3-D and 2-D x 2-D with offsets) runs on CPU in float32 in
  2.13; where it is missing or refuses CPU the emulated grouped GEMM loops over experts:
  ``grouped_mm_available``. ``torch._scaled_grouped_mm`` (float8, CUDA SM90+) is asked for by
  ``scaled_grouped_mm_available``.
- ``torch.nn.functional.scaled_mm`` calls ``torch._scaled_mm_v2``, which torch 2.11's Dynamo
  does not trace (a graph break, an error under ``fullgraph=True``); the aten op itself
  traces on every version: ``scaled_mm_v2``.
- Under ``torch.compile``, 2.11 tags a checkpointed region's ops for recompute by walking
  the region's graph (``TagActivationCheckpoint.tag_nodes``), which does not enter the
  subgraphs of a custom ``autograd.Function`` (Dynamo's ``autograd_function_apply``): the
  partitioner then saves what a float8 linear computes inside a checkpointed block instead
  of recomputing it, so checkpointing saves no memory there. 2.13 and later tag through the
  dispatch mode, which reaches them. Where the walk is there, its tags are extended to
  the nested subgraphs, once at import: ``checkpoint_tags_reach_functions``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_single",
    "checkpoint_tags_reach_functions",
    "cpu_scaled_mm_takes_row_scales",
    "grouped_mm_available",
    "premul_sum",
    "probe_device",
    "premul_sum_factor",
    "reduce_scatter_single",
    "scaled_grouped_mm_available",
    "scaled_mm_v2",
]


def scaled_mm_v2(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: list[torch.Tensor],
    recipe_a: list,
    scale_b: list[torch.Tensor],
    recipe_b: list,
    swizzle_a: list | None = None,
    swizzle_b: list | None = None,
    *,
    output_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``F.scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, swizzle_a, swizzle_b)`` with
    every argument a list (recipes and swizzles as ``F.ScalingType`` / ``F.SwizzleType``),
    as the aten op ``F.scaled_mm`` reaches, so that Dynamo traces it on every torch."""
    return torch.ops.aten._scaled_mm_v2.default(
        a,
        b,
        scale_a,
        [r.value for r in recipe_a],
        [s.value for s in swizzle_a or []],
        scale_b,
        [r.value for r in recipe_b],
        [s.value for s in swizzle_b or []],
        None,
        output_dtype,
        [],
        use_fast_accum,
    )


_ROW_SCALES: bool | None = None
_GROUPED_MM: dict[str, bool] = {}


# assume_constant_result: under torch.compile the probe runs eagerly and its answer is a
# constant in the graph, not a traced GEMM.
@torch.compiler.assume_constant_result
def cpu_scaled_mm_takes_row_scales() -> bool:
    """Whether CPU ``torch._scaled_mm`` accepts (M, 1) / (1, N) float32 scales (one tiny
    call at first use; the answer is kept)."""
    global _ROW_SCALES
    if _ROW_SCALES is None:
        _ROW_SCALES = _probe_row_scales()
    return _ROW_SCALES


def _probe_row_scales() -> bool:
    cpu = torch.device("cpu")  # explicit: an import under a torch.device("meta") context
    a = torch.ones(2, 16, device=cpu).to(torch.float8_e4m3fn)
    b = torch.ones(2, 16, device=cpu).to(torch.float8_e4m3fn).t()
    try:
        out = torch._scaled_mm(
            a,
            b,
            torch.ones(2, 1, device=cpu),
            torch.full((1, 2), 2.0, device=cpu),
            out_dtype=torch.float32,
        )
    except RuntimeError:  # torch 2.11: "only supports per-tensor scaling for CPU backend"
        return False
    return bool((out == 32.0).all())


@torch.compiler.assume_constant_result
def grouped_mm_available(device_type: str = "cpu") -> bool:
    """Whether ``torch._grouped_mm`` runs float32 2-D x 3-D groups on this device type (one
    tiny call per device type at first use; the answer is kept)."""
    if device_type not in _GROUPED_MM:
        _GROUPED_MM[device_type] = _probe_grouped_mm(device_type)
    return _GROUPED_MM[device_type]


def _probe_grouped_mm(device_type: str) -> bool:
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        return False
    a = torch.ones(3, 16, device=device_type)
    b = torch.ones(2, 16, 8, device=device_type)
    offs = torch.tensor([1, 3], dtype=torch.int32, device=device_type)
    try:
        out = fn(a, b, offs=offs)
    except (RuntimeError, NotImplementedError):  # no kernel for this device or dtype
        return False
    return tuple(out.shape) == (3, 8) and bool((out == 16.0).all())


def probe_device(device: torch.device | str) -> None:
    """Run the probes a module on `device` will ask for, now (at conversion), not first
    inside a forward; no-op for meta and already-probed device types."""
    device_type = torch.device(device).type
    if device_type != "meta" and device_type not in _GROUPED_MM:
        _GROUPED_MM[device_type] = _probe_grouped_mm(device_type)


def scaled_grouped_mm_available(device: torch.device) -> bool:
    """Whether ``torch._scaled_grouped_mm`` can run on ``device``: CUDA of compute capability
    9.0 or higher (Hopper, Blackwell) with a torch that has the op; never on CPU."""
    if getattr(torch, "_scaled_grouped_mm", None) is None or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def premul_sum(factor: float | torch.Tensor) -> dist.ReduceOp:
    """``ReduceOp.PREMUL_SUM`` with ``factor``, built the way this torch builds it."""
    make = dist.ReduceOp.PREMUL_SUM
    if callable(make):
        return make(factor)
    return dist._make_nccl_premul_sum(factor)


def premul_sum_factor(op: dist.ReduceOp) -> float | torch.Tensor | None:
    """The factor of a ``PREMUL_SUM`` op, or None where this torch does not expose it."""
    return getattr(op, "factor", None)


def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None
) -> None:
    """All-gather ``input`` of every rank into ``output`` (concatenated along dim 0)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Reduce ``input`` over ranks and scatter it: rank r gets chunk r in ``output``."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, input, op=op, group=group)


def checkpoint_tags_reach_functions() -> bool:
    """Make a compiled checkpointed region's recompute tags reach the ops inside its custom
    `autograd.Function`s (module docstring); True when this torch needed it (its tagging
    walks the region's top-level graph only). Idempotent."""
    from torch._higher_order_ops import wrap

    tagger = getattr(wrap, "TagActivationCheckpoint", None)
    walk = getattr(tagger, "tag_nodes", None)
    if walk is None:  # tags come from the dispatch mode: every op is reached
        return False
    if getattr(walk, "reaches_subgraphs", False):
        return True

    def tag_nodes(gmod, is_sac):
        gmod = walk(gmod, is_sac)
        tags = [node.meta for node in gmod.graph.nodes if "ac_graph_id" in node.meta]
        if tags:
            _copy_tags(gmod, tags[0]["ac_graph_id"], tags[0]["recompute"])
        return gmod

    tag_nodes.reaches_subgraphs = True  # type: ignore[attr-defined]
    assert tagger is not None
    tagger.tag_nodes = staticmethod(tag_nodes)
    return True


def _copy_tags(gmod: torch.fx.GraphModule, graph_id: int, recompute) -> None:
    """The region's tags onto every op of the forward bodies of the custom
    `autograd.Function`s its graph calls (Dynamo's `autograd_function_apply`, whose first
    argument is the forward body), at any depth. Backward bodies run in the backward: no
    recompute decision is theirs."""
    for node in gmod.graph.nodes:
        if node.op != "call_function" or "autograd_function_apply" not in str(node.target):
            continue
        body_ref = node.args[0] if node.args else None
        body = getattr(gmod, str(getattr(body_ref, "target", "")), None)
        if not isinstance(body, torch.fx.GraphModule):
            continue
        for inner in body.graph.nodes:
            if inner.op in ("call_function", "call_method", "call_module"):
                inner.meta["ac_graph_id"] = graph_id
                inner.meta["recompute"] = recompute
        _copy_tags(body, graph_id, recompute)


# once at import (see the module docstring): the CPU probes, and the checkpoint-tag mend
with torch.no_grad():
    _ROW_SCALES = _probe_row_scales()
    _GROUPED_MM["cpu"] = _probe_grouped_mm("cpu")
CHECKPOINT_TAGS_MENDED = checkpoint_tags_reach_functions()
