"""`torch.autograd.grad` walked in Python, as the C++ engine walks it (`python_grad`).

`f8train/gpu_codegen.py` patches `torch.autograd.grad` with it for cuda tensors: AOTAutograd
traces the joint graph with `torch.autograd.grad`, and with no GPU the C++ engine cannot run
cuda nodes (it asks for a CUDA context). Nodes run in the engine's order (a node once all
its consumers ran, highest sequence nr first), each gradient summed to its input's shape
and cast to its dtype.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from typing import Any

import torch


def _sum_to(grad: torch.Tensor, meta: Any) -> torch.Tensor:
    if tuple(grad.shape) != tuple(meta.shape):
        grad = grad.sum_to_size(meta.shape)
    return grad if grad.dtype == meta.dtype else grad.to(meta.dtype)


def engine_order(roots: list) -> list:
    """The order the engine runs the nodes reachable from `roots`: a node once every node
    feeding it a gradient has run, the ready one with the highest sequence number first
    (AccumulateGrad before all: FSDP2's post-backward reads the accumulated gradients)."""
    deps: dict = defaultdict(int)
    seen, stack = set(roots), list(roots)
    while stack:
        for nxt, _ in stack.pop().next_functions:
            if nxt is None:
                continue
            deps[nxt] += 1
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)

    def priority(node: Any) -> float:
        return -math.inf if type(node).__name__ == "AccumulateGrad" else -node._sequence_nr()

    ready = [(priority(n), id(n), n) for n in dict.fromkeys(roots) if deps[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        node = heapq.heappop(ready)[2]
        order.append(node)
        for nxt, _ in node.next_functions:
            if nxt is not None:
                deps[nxt] -= 1
                if deps[nxt] == 0:
                    heapq.heappush(ready, (priority(nxt), id(nxt), nxt))
    return order


def _run_node(node: Any, given: dict) -> tuple:
    metadata = node._input_metadata
    inputs = [given.get(i) for i in range(len(metadata))]
    inputs = [
        g if g is not None else torch.zeros(m.shape, dtype=m.dtype, device=m.device)
        for g, m in zip(inputs, metadata)
    ]
    results = node.apply(*inputs) if hasattr(node, "_forward_cls") else node(*inputs)
    results = results if isinstance(results, tuple) else (results,)
    edges = len(node.next_functions)
    if len(results) != edges:  # a custom Function returns one value per input, tensor or not
        wanted = list(getattr(node, "needs_input_grad", ()))
        if len(wanted) != len(results) or sum(wanted) != edges:
            raise RuntimeError(f"gpu_codegen: cannot map the gradients of {node}")
        results = tuple(r for r, w in zip(results, wanted) if w)
    return results


def python_grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
                only_inputs=True, allow_unused=None, is_grads_batched=False,
                materialize_grads=False):  # fmt: skip
    """`torch.autograd.grad` walked in Python, as the C++ engine does."""
    outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    if grad_outputs is None or isinstance(grad_outputs, torch.Tensor):
        grad_outputs = [grad_outputs] * (1 if grad_outputs is not None else len(outputs))
    grad_outputs = [torch.ones_like(o) if g is None else g for o, g in zip(outputs, grad_outputs)]
    targets: dict = defaultdict(list)
    for i, t in enumerate(inputs):
        edge = torch.autograd.graph.get_gradient_edge(t)
        targets[(edge.node, edge.output_nr)].append(i)
    pending: dict = defaultdict(dict)
    roots = []
    for out, grad in zip(outputs, grad_outputs):
        edge = torch.autograd.graph.get_gradient_edge(out)
        slot = pending[edge.node]
        nr = edge.output_nr
        slot[nr] = grad if nr not in slot else slot[nr] + grad
        roots.append(edge.node)
    target_nodes = {node for node, _ in targets}
    with torch.set_grad_enabled(bool(create_graph)):
        for node in engine_order(roots):
            given = pending[node]
            if node in target_nodes or type(node).__name__ == "AccumulateGrad":
                continue
            for (nxt, nr), grad in zip(node.next_functions, _run_node(node, given)):
                if nxt is not None and grad is not None:
                    grad = _sum_to(grad, nxt._input_metadata[nr])
                    slot = pending[nxt]
                    slot[nr] = grad if nr not in slot else slot[nr] + grad
    result: list = [None] * len(inputs)
    for (node, nr), idxs in targets.items():
        for i in idxs:
            result[i] = pending.get(node, {}).get(nr)
    if not allow_unused and not materialize_grads and any(r is None for r in result):
        raise RuntimeError("One of the differentiated Tensors appears to not have been used")
    if materialize_grads:
        result = [torch.zeros_like(t) if r is None else r for t, r in zip(inputs, result)]
    return tuple(result)
