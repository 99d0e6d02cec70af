"""Fake CUDA: run the library's CUDA paths on a CPU, with the CUDA build of torch.

Mental model: under `FakeTensorMode` a tensor on "cuda" is metadata only (shape, dtype,
strides, device) and every aten op runs its meta kernel, which checks layouts, scale
shapes and dtypes as the CUDA op does (`torch._scaled_mm`: "mat2 must be col_major").
`fake_cuda(capability)` adds what the meta kernels do not know:

- the device: `torch.cuda.get_device_capability` answers (9, 0) (H200) or (10, 0) (B200),
  so the library takes its CUDA branches (never `is_available`: fake tensors would then
  start a real CUDA context);
- autocast: `torch.autocast("cuda")` disables itself without a driver; here it stays on;
- the rules that live only in the CUDA kernels, written from torch 2.11's ScaledBlas.cpp
  (the strings are in its libtorch_cuda.so): `KERNEL_RULES`. A broken rule raises
  `CudaRuleBroken`, whose message starts with the rule's name; so does a meta kernel's
  refusal of a float8 GEMM;
- values: a fake tensor has none, so reading one (`.item()`, `bool(t)`, `torch.equal`)
  gives a placeholder: 1.0, 0, and `truth` for a bool (False by default, so a library check
  `if bad.any(): raise` and a redraw loop `while x.any()` pass; True to run a test whose
  value assertions then pass vacuously). This lane checks that every CUDA call is one the
  kernels accept, never numbers (tests/gpu does that, on a GPU).

Backward: the C++ autograd engine needs a CUDA context for cuda tensors, so `backward`
walks the graph in Python, as the engine would: nodes in reverse topological order, each
gradient summed to its input's shape and cast to its dtype (what the engine's
validate_outputs does), leaf gradients accumulated into `.grad`. Tensor hooks do not run.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from f8train.gpu_autograd import engine_order

aten = torch.ops.aten
H200, B200 = (9, 0), (10, 0)


class CudaRuleBroken(RuntimeError):
    """A CUDA kernel would refuse this call; the message starts with the rule's name."""

    def __init__(self, rule: str, detail: str):
        super().__init__(f"CUDA rule [{rule}] broken: {detail}")
        self.rule = rule


def _row_scaled(scale: torch.Tensor) -> bool:
    return scale.numel() != 1 and scale.dtype == torch.float32


def _scaled_mm_rules(capability, args, kwargs) -> None:
    """`torch._scaled_mm`'s kernel-only checks (torch 2.11, ScaledBlas.cpp, CUDA)."""
    a, b, scale_a, scale_b = args[:4]
    out_dtype = kwargs.get("out_dtype") or (args[6] if len(args) > 6 else None) or a.dtype
    bias = kwargs.get("bias") if "bias" in kwargs else (args[4] if len(args) > 4 else None)
    if capability < (8, 9):
        raise CudaRuleBroken("scaled_mm.arch", f"float8 GEMMs need SM89+, device is {capability}")
    if a.dtype == b.dtype == torch.float8_e5m2:
        raise CudaRuleBroken(
            "scaled_mm.e5m2_pair", "Multiplication of two Float8_e5m2 matrices is not supported"
        )
    if _row_scaled(scale_a) and out_dtype not in (torch.bfloat16, torch.float16):
        raise CudaRuleBroken(
            "scaled_mm.rowwise_out_dtype",
            f"row-wise scaling asks for a {out_dtype} output; the kernel gives bf16 and "
            "fp16 only ('Only bf16 and fp16 high precision output types are supported for "
            "row-wise scaling.')",
        )
    if bias is not None and out_dtype == torch.float32:
        raise CudaRuleBroken("scaled_mm.bias_fp32", "Bias is not supported with a float32 output")


def _scaled_grouped_mm_rules(capability, args, kwargs) -> None:
    """`torch._scaled_grouped_mm`'s kernel-only checks (torch 2.11, CUDA)."""
    scale_a, scale_b = args[2], args[3]
    out_dtype = kwargs.get("out_dtype") or (args[7] if len(args) > 7 else None)
    if capability < (9, 0):
        raise CudaRuleBroken("scaled_grouped_mm.arch", f"needs SM90+, device is {capability}")
    if out_dtype not in (None, torch.bfloat16):
        raise CudaRuleBroken(
            "scaled_grouped_mm.out_dtype",
            f"asks for {out_dtype}; 'Only bf16 high precision output types are supported "
            "for grouped gemm'",
        )
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        raise CudaRuleBroken(
            "scaled_grouped_mm.scale_dtype",
            f"scales {scale_a.dtype}, {scale_b.dtype}: 'For grouped FP8 rowwise, both "
            "scales must be float32 tensors'",
        )


def _block_scaled_mm_rules(capability, args, kwargs) -> None:
    """`torch.nn.functional.scaled_mm` (aten._scaled_mm_v2(self, mat2, scale_a, recipe_a,
    swizzle_a, scale_b, ...)) with block scales. MX and NVFP4 GEMMs need SM100+: torch's
    test_scaled_matmul_cuda.py runs them only where PLATFORM_SUPPORTS_MX_GEMM ('MX gemm is
    only supported on CUDA capability 10.0+'); ScaledBlas.cpp leaves that check to cuBLAS."""
    scales = list(args[2]) + list(args[5])
    if any(s.dtype == torch.float8_e8m0fnu for s in scales) and capability < (10, 0):
        raise CudaRuleBroken("scaled_mm_v2.mx_arch", f"MXFP8 GEMMs need SM100+, got {capability}")
    if args[0].dtype == torch.float4_e2m1fn_x2 and capability < (10, 0):
        raise CudaRuleBroken("scaled_mm_v2.fp4_arch", f"FP4 GEMMs need SM100+, got {capability}")


KERNEL_RULES: dict[str, Callable] = {
    "_scaled_mm": _scaled_mm_rules,
    "_scaled_grouped_mm": _scaled_grouped_mm_rules,
    "_scaled_mm_v2": _block_scaled_mm_rules,
}
_GEMM_OPS = ("_scaled_mm", "_scaled_grouped_mm", "_scaled_mm_v2", "_grouped_mm")


class _CudaKernelRules(TorchDispatchMode):
    """Above FakeTensorMode: applies KERNEL_RULES, names a meta kernel's GEMM refusal as a
    broken rule, and answers value reads with placeholders."""

    def __init__(self, capability: tuple[int, int], truth: bool):
        super().__init__()
        self.capability = capability
        self.truth = truth
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            return _placeholder(args[0].dtype, self.truth)
        if name in ("equal", "is_nonzero"):
            return self.truth
        if name == "bincount":  # data-dependent size: assume every value < minlength
            return torch.zeros(kwargs.get("minlength", args[2] if len(args) > 2 else 0),
                               dtype=torch.int64, device=args[0].device)  # fmt: skip
        on_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        if name in KERNEL_RULES and on_cuda:
            KERNEL_RULES[name](self.capability, args, kwargs)
        if on_cuda:
            self.calls[name] += 1
        try:
            return func(*args, **kwargs)
        except RuntimeError as err:
            if name in _GEMM_OPS and on_cuda and not isinstance(err, CudaRuleBroken):
                raise CudaRuleBroken(f"{name}.meta", str(err).splitlines()[0]) from None
            raise


class _HookedGraph:
    """What the C++ engine would run besides the nodes: tensor hooks registered on
    non-leaf tensors (FSDP2's pre-backward) and callbacks queued for the end of backward
    (FSDP2's root post-backward)."""

    def __init__(self):
        self.hooks: dict = defaultdict(list)  # grad_fn -> [(output_nr, hook)]
        self.callbacks: list[Callable] = []
        self.tensor_inputs: dict = {}  # custom Function node -> which inputs are tensors
        self._register = torch.Tensor.register_hook

    def register_hook(self, tensor: torch.Tensor, hook):
        if tensor.grad_fn is not None:
            self.hooks[tensor.grad_fn].append((tensor.output_nr, hook))
        return self._register(tensor, hook)

    def queue_callback(self, callback: Callable) -> None:
        self.callbacks.append(callback)

    def function_apply(self, cls, *args, **kwargs):
        """autograd.Function.apply, noting which inputs are tensors: backward returns one
        value per input, the graph has an edge per tensor input only."""
        out = _FUNCTION_APPLY.__get__(None, cls)(*args, **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        node = next((o.grad_fn for o in outs if isinstance(o, torch.Tensor) and o.grad_fn), None)
        if node is not None:
            self.tensor_inputs[node] = [isinstance(a, torch.Tensor) for a in args]
        return out


_GRAPH: _HookedGraph | None = None
# a classmethod up to torch 2.14, a C classmethod_descriptor (no __func__) from 2.15: both
# bind to a class through __get__
_FUNCTION_APPLY = torch.autograd.Function.__dict__["apply"]


def _placeholder(dtype: torch.dtype, truth: bool):
    if dtype == torch.bool:
        return truth
    return 1.0 if dtype.is_floating_point else 0


@contextlib.contextmanager
def fake_cuda(
    capability: tuple[int, int] = H200, *, truth: bool = False
) -> Iterator[_CudaKernelRules]:
    """Fake cuda tensors with the CUDA kernels' rules; yields the rules mode (`.calls`
    counts the aten ops that ran on cuda, by name)."""
    global _GRAPH
    rules = _CudaKernelRules(tuple(capability), truth)
    amp = torch.cuda.amp.common
    graph = _GRAPH = _HookedGraph()
    engine = mock.Mock(wraps=torch.autograd.Variable._execution_engine)
    engine.queue_callback = graph.queue_callback
    # FakeTensorMode logs each meta kernel's refusal at ERROR level before it is raised
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    with (
        mock.patch.object(fake_log, "disabled", True),
        mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: capability),
        mock.patch.object(amp, "amp_definitely_not_available", lambda: False),
        mock.patch.object(torch.cuda, "is_bf16_supported", lambda *a, **k: True),
        mock.patch.object(
            torch.Tensor, "register_hook", lambda t, hook: graph.register_hook(t, hook)
        ),
        mock.patch.object(torch.autograd.Variable, "_execution_engine", engine),
        mock.patch.object(torch.autograd.Function, "apply", classmethod(graph.function_apply)),
        FakeTensorMode(allow_non_fake_inputs=True),
        rules,
    ):
        yield rules


def backward(outputs, grads=None) -> None:
    """`torch.autograd.backward(outputs, grads)` walked in Python (see the module)."""
    outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    if grads is None:
        grads = [torch.ones_like(o) for o in outputs]
    grads = [grads] if isinstance(grads, torch.Tensor) else list(grads)
    pending: dict = defaultdict(dict)
    roots = []
    for out, grad in zip(outputs, grads):
        if out.grad_fn is None:  # a leaf output: its gradient is the given one
            _accumulate(out, grad)
            continue
        roots.append(out.grad_fn)
        _add(pending[out.grad_fn], out.output_nr, grad)
    # grad mode off, as the engine runs a backward without create_graph (the float8 layers
    # refuse a backward under grad mode: a double backward)
    with torch.no_grad():
        for node in engine_order(roots):
            _run_node(node, pending.pop(node, {}), pending)
        while _GRAPH is not None and _GRAPH.callbacks:
            _GRAPH.callbacks.pop(0)()


def _run_node(node, given: dict, pending: dict) -> None:
    for nr, hook in _GRAPH.hooks.get(node, ()) if _GRAPH is not None else ():
        if nr in given:
            changed = hook(given[nr])
            given[nr] = given[nr] if changed is None else changed
    if type(node).__name__ == "AccumulateGrad":
        if 0 in given:
            _accumulate(node.variable, given[0])
        return
    metadata = node._input_metadata
    inputs = [given.get(i) for i in range(len(metadata))]
    if hasattr(node, "_forward_cls"):  # a custom autograd.Function
        results = node.apply(*inputs)
        results = results if isinstance(results, tuple) else (results,)
        mask = _GRAPH.tensor_inputs.get(node) if _GRAPH is not None else None
        if mask is not None and len(mask) == len(results):
            results = tuple(r for r, is_tensor in zip(results, mask) if is_tensor)
    else:
        results = node(*[g if g is not None else _zeros(m) for g, m in zip(inputs, metadata)])
    results = results if isinstance(results, tuple) else (results,)
    for (nxt, nr), grad in zip(node.next_functions, results):
        if nxt is not None and grad is not None:
            _add(pending[nxt], nr, _fit(grad, nxt._input_metadata[nr]))


def _zeros(meta) -> torch.Tensor:
    return torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device)


def _fit(grad: torch.Tensor, meta) -> torch.Tensor:
    """What the engine's validate_outputs does: sum a broadcast gradient to the input's
    shape and cast it to the input's dtype."""
    if tuple(grad.shape) != tuple(meta.shape):
        grad = grad.sum_to_size(meta.shape)
    if grad.dtype != meta.dtype:
        grad = grad.to(meta.dtype)
    return grad


def _add(slots: dict, nr: int, grad: torch.Tensor) -> None:
    slots[nr] = grad if nr not in slots else slots[nr] + grad


def _accumulate(leaf: torch.Tensor, grad: torch.Tensor) -> None:
    with torch.no_grad():
        leaf.grad = grad.detach() if leaf.grad is None else leaf.grad + grad
