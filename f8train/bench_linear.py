"""Float8Linear (each recipe) against nn.Linear in bf16: forward + backward of one layer.

Run (from the repository root):
    python -m f8train.bench_linear                                   # CPU shapes, eager
    python -m f8train.bench_linear --compile --json out/linear_cpu.json
    python -m f8train.bench_linear --device cuda --compile --shapes llama --json out/linear.json
    python -m f8train.bench_linear --quick --json /tmp/linear.json   # smoke test sizes

A shape is (M tokens, K in, N out); a step is `layer(x).backward(grad_output)` in bf16 (the
three GEMMs, 6*M*K*N FLOPs, and every cast) for `nn.Linear` and each recipe's
`Float8Linear.from_float` of it. Columns: median ms, speedup = bf16 / float8, the float8
output's SQNR against bf16, on a known GPU TFLOP/s and % of the dense peak; a failing case
is a row with its error. On the CPU float8 is emulated: CPU rows measure overhead only.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from f8train.bench_common import (
    ERROR,
    Report,
    bench_parser,
    column,
    fmt,
    markdown_table,
    parse_choices,
    parse_dims,
    peak_tflops,
    resolve_device,
    short_error,
    synchronize,
    time_ms,
    write_json,
)
from f8train.op_counter import OpCounter
from fsdp_float8 import Float8Linear, Float8LinearConfig
from fsdp_float8.core.numerics import sqnr_db

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8")


class Shape(NamedTuple):
    name: str
    m: int
    k: int
    n: int


def _llama3(size: str, d: int, kv: int, h: int) -> list[Shape]:
    """Llama-3's linear layers (dim, kv dim, ffn hidden) at 16384 tokens."""
    layers = {"attn.wq/wo": (d, d), "attn.wk/wv": (d, kv), "ffn.w1/w3": (d, h), "ffn.w2": (h, d)}
    return [Shape(f"llama3_{size}.{name}", 16384, k, n) for name, (k, n) in layers.items()]


PRESETS = {
    "quick": [Shape("tiny", 32, 64, 128), Shape("tiny_t", 64, 128, 64)],
    "cpu": [
        Shape("square_1k", 512, 1024, 1024),
        Shape("up_1k_4k", 512, 1024, 4096),
        Shape("down_4k_1k", 512, 4096, 1024),
        Shape("llama3_8b.attn.wk/wv", 256, 4096, 1024),
    ],
    "llama": _llama3("8b", 4096, 1024, 14336) + _llama3("70b", 8192, 1024, 28672),
}


def _layer(base: nn.Linear, recipe: str | None, mode: str) -> nn.Module:
    layer: nn.Module = base
    if recipe is not None:
        layer = Float8Linear.from_float(base, Float8LinearConfig.from_recipe_name(recipe))
    if mode == "compile":
        torch._dynamo.reset()  # each case compiled on its own
        layer = torch.compile(layer)
    return layer


def _step(layer: nn.Module, x: torch.Tensor, grad_output: torch.Tensor):
    def step() -> None:
        for t in (x, *layer.parameters()):
            t.grad = None
        layer(x).backward(grad_output)

    return step


def run_case(base, recipe, mode, x, grad_output, device, args) -> dict:
    """Time one (layer, mode); its output for the SQNR column; with `--kernels` the
    GEMM / other split of one more step."""
    try:
        layer = _layer(base, recipe, mode)
        step = _step(layer, x, grad_output)
        timing = time_ms(step, device, warmup=args.warmup, iters=args.iters)
        split = kernel_breakdown(step, device) if args.kernels else None
        with torch.no_grad():
            out = layer(x)
        synchronize(device)
        return {**timing, "output": out, "split": split, "error": None}
    except Exception as exc:  # a row with the error, not the end of the run
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"median_ms": None, "output": None, "error": short_error(exc)}


def _inputs(shape: Shape, device):
    torch.manual_seed(0)
    base = nn.Linear(shape.k, shape.n, bias=False, device=device, dtype=torch.bfloat16)
    x = torch.randn(shape.m, shape.k, device=device, dtype=torch.bfloat16, requires_grad=True)
    return base, x, torch.randn(shape.m, shape.n, device=device, dtype=torch.bfloat16)


def bench_shape(shape: Shape, args, device, peaks, report: Report) -> None:
    base, x, grad_output = _inputs(shape, device)
    flops = 6 * shape.m * shape.k * shape.n
    for mode in args.modes:
        ref = run_case(base, None, mode, x, grad_output, device, args)
        for recipe in args.recipes:
            res = run_case(base, recipe, mode, x, grad_output, device, args)
            row = {"shape": shape.name, "M": shape.m, "K": shape.k, "N": shape.n}
            row |= {"mode": mode, "recipe": recipe, "error": ref["error"] or res["error"]}
            for name, r, peak in (("bf16", ref, "bf16"), ("float8", res, "fp8")):
                ms = r["median_ms"]
                tflops = row[f"{name}_tflops"] = flops / (ms * 1e-3) / 1e12 if ms else None
                row[f"{name}_ms"] = ms
                if args.kernels:
                    row[f"{name}_split"] = r.get("split")
                if tflops and (peaks or {}).get(peak):
                    row[f"{name}_pct_peak"] = 100 * tflops / peaks[peak]
            both = ref["median_ms"] and res["median_ms"]
            row["speedup"] = ref["median_ms"] / res["median_ms"] if both else None
            outs = ref["output"], res["output"]
            row["output_sqnr_db"] = sqnr_db(*outs) if None not in outs else None
            report.add(row)


def _columns(peaks, kernels: bool) -> list:
    cols = [column("shape", "shape"), ("M x K x N", lambda r: f"{r['M']}x{r['K']}x{r['N']}")]
    cols += [column("mode", "mode"), column("recipe", "recipe")]
    cols += [column("bf16 ms", "bf16_ms", ".3f"), column("float8 ms", "float8_ms", ".3f")]
    cols += [column("speedup", "speedup"), column("out SQNR dB", "output_sqnr_db", ".1f")]
    for name, peak in (("bf16", "% peak"), ("float8", "% fp8 peak")) if peaks else ():
        cols.append((f"{name} TFLOP/s ({peak})", partial(_tflops_cell, name)))
    for name in ("bf16", "float8") if kernels else ():
        cols.append((f"{name} GEMM / other ms", partial(_split_cell, name)))
    if kernels:
        cols.append(
            ("float8 kernels", lambda r: fmt((r["float8_split"] or {}).get("kernels"), "d"))
        )
    return cols + [ERROR]


def _tflops_cell(name: str, r: dict) -> str:
    return f"{fmt(r[f'{name}_tflops'], '.0f')} ({fmt(r.get(f'{name}_pct_peak'), '.0f')}%)"


def _split_cell(name: str, r: dict) -> str:
    split = r[f"{name}_split"]
    return f"{fmt(split['gemm_ms'], '.3f')} / {fmt(split['other_ms'], '.3f')}" if split else "-"


GEMM_KERNEL_WORDS = ("gemm", "nvjet", "xmma", "cutlass", "wgmma")  # cuBLAS(Lt), CUTLASS
GEMM_OPS = ("aten::mm", "aten::_scaled_mm", "aten::addmm", "aten::bmm", "aten::matmul")


def kernel_breakdown(step, device: torch.device) -> dict:
    """One `step()`'s GEMM time and the rest. CUDA: kernel times, a GEMM by its name, and the
    launch count. CPU: the outermost GEMM ops' CPU time (children included: `_scaled_mm`
    dequantizes inside) against the step's wall time (compiled kernels are "other")."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, *[ProfilerActivity.CUDA] * cuda]) as prof:
        step()
        synchronize(device)
    events, count = list(prof.events()), None
    if cuda:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        times = [(e.name.lower(), e.time_range.elapsed_us() / 1e3) for e in kernels]
        gemm = sum(t for name, t in times if any(w in name for w in GEMM_KERNEL_WORDS))
        total, count = sum(t for _, t in times), len(kernels)
    else:
        total = sum(e.time_range.elapsed_us() for e in events if e.cpu_parent is None) / 1e3
        gemm = sum(e.cpu_time_total for e in events if _outermost_gemm(e)) / 1e3
    share = gemm / total if total else None
    return {
        "gemm_ms": gemm,
        "other_ms": max(total - gemm, 0.0),
        "gemm_share": share,
        "kernels": count,
    }


def _outermost_gemm(event) -> bool:
    parent = event.cpu_parent
    while parent is not None and parent.name not in GEMM_OPS:
        parent = parent.cpu_parent
    return event.name in GEMM_OPS and parent is None


REDUCTIONS = ("amax", "amin", "aminmax", "max", "linalg_vector_norm", "_foreach_norm")
PASSES = ("_to_copy", "mul", "mul_", "clamp", "clamp_", "abs", "reciprocal", "div")


def op_kind(small_numel: int):
    """OpCounter's `kind` for a float8 linear: what an op does to its cost; a tensor of at
    most `small_numel` elements is a scale, not an operand."""

    def kind(name: str, args, kwargs) -> str:
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name == "_local_scalar_dense":
            return "host reads (.item())"
        if name in ("_scaled_mm", "cpu_scaled_mm", "mm", "addmm"):
            return "GEMMs"
        if first is None or first.numel() <= small_numel:
            return "small ops (scales)"
        if name in REDUCTIONS:
            return "amax reductions"
        if name == "_to_copy" and kwargs.get("dtype", first.dtype).itemsize == 1:
            return "float8 casts (writes)"
        if first.dtype.itemsize == 1 and name in ("clone", "contiguous", "_to_copy"):
            return "float8 layout copies (transposes)"
        return "elementwise passes over operands" if name in PASSES else "other"

    return kind


def profile_recipes(shape: Shape, recipes: list[str], device) -> dict:
    """The aten ops of one eager forward + backward per recipe by kind, printed as a table."""
    base, x, grad_output = _inputs(shape, device)
    report = {}
    for recipe in recipes:
        step = _step(_layer(base, recipe, "eager"), x, grad_output)
        step()
        with OpCounter(kind=op_kind(max(shape.m, shape.n, shape.k))) as counter:
            step()
        report[recipe] = {"kinds": dict(counter.kinds.most_common()), "ops": dict(counter.top)}
    print(f"\nop census, one forward + backward of {shape.m}x{shape.k}x{shape.n} (eager)")
    kinds = sorted({k for r in report.values() for k in r["kinds"]})
    rows = [[k] + [r["kinds"].get(k, 0) for r in report.values()] for k in kinds]
    rows.append(["total aten ops"] + [sum(r["kinds"].values()) for r in report.values()])
    print(markdown_table(["kind", *report], rows))
    return report


def main(argv: list[str] | None = None) -> dict:
    p = bench_parser(__doc__)
    p.add_argument("--shapes", default=None, help="quick | cpu | llama | MxKxN,...")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipe names")
    p.add_argument("--compile", action="store_true", help="also run torch.compile'd layers")
    p.add_argument("--compile-only", action="store_true", help="only torch.compile'd layers")
    p.add_argument("--profile", action="store_true", help="aten ops by kind, first shape")
    p.add_argument("--kernels", action="store_true", help="GEMM / other time split per case")
    args = p.parse_args(argv)
    args.recipes = parse_choices(p, args.recipes, RECIPES, "recipe(s)")
    args.modes = ["compile"] if args.compile_only else ["eager", "compile"][: 1 + args.compile]
    device = resolve_device(args.device, threads=args.threads)
    cuda = device.type == "cuda"
    args.shapes = args.shapes or ("quick" if args.quick else "llama" if cuda else "cpu")
    shapes = PRESETS.get(args.shapes) or [
        Shape(f"{m}x{k}x{n}", m, k, n) for m, k, n in parse_dims(p, "--shapes", args.shapes, 3)
    ]
    args.warmup = args.warmup if args.warmup is not None else 5 if cuda and not args.quick else 1
    args.iters = args.iters if args.iters is not None else 2 if args.quick else 20 if cuda else 5
    peaks = peak_tflops(device)
    report = Report("linear", device, args, _columns(peaks, args.kernels), peak_tflops=peaks)
    for shape in shapes:
        bench_shape(shape, args, device, peaks, report)
    payload = report.done()
    if args.profile:
        profile = profile_recipes(shapes[0], args.recipes, device)
        payload["profile"] = {"shape": shapes[0]._asdict(), **profile}
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
