"""Float8Linear (each recipe) against nn.Linear in bf16: forward + backward of one layer.

Run (from the repository root):
    python -m f8train.bench_linear                                   # CPU shapes, eager
    python -m f8train.bench_linear --compile --json out/linear_cpu.json
    python -m f8train.bench_linear --device cuda --compile --shapes llama --json out/linear.json
    python -m f8train.bench_linear --quick --json /tmp/linear.json   # smoke test sizes

Mental model: a shape is (M tokens, K in_features, N out_features). For each shape there is
one `nn.Linear(K, N, bias=False)` in bf16 and, per recipe, a `Float8Linear.from_float` of
it (same weight). One timed step is `layer(x).backward(grad_output)` with `x` (M, K) and
`grad_output` (M, N) in bf16: the three GEMMs of a linear layer, 6*M*K*N FLOPs, plus every
cast. Modes: `eager`, and `compile` (`torch.compile` of the layer, forward and backward;
each case compiled afresh). A case that fails (an unsupported op, a compile error, out of
memory) becomes a row with its error instead of ending the run.

Columns: bf16 and float8 median ms, speedup = bf16 / float8, the float8 output's SQNR
against the bf16 output, and on a known GPU the achieved TFLOP/s with the fraction of the
device's dense peak (bf16 against the bf16 peak, float8 against the fp8 peak). With
`--kernels`, one more profiled step per case splits its time into GEMMs and everything else
(`f8train/bench_kernels.py`): the columns that say whether a float8 row is held back by its
GEMMs or by the casts around them. On the CPU
float8 is emulated by torch._scaled_mm (dequantize + float32 GEMM), so CPU rows measure
overhead, not float8 speed.
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from f8train.bench_common import (
    environment,
    fmt,
    markdown_table,
    parse_choices,
    peak_tflops,
    reset_compiler,
    resolve_device,
    short_error,
    synchronize,
    time_ms,
    write_json,
)
from f8train.bench_kernels import kernel_breakdown
from fsdp_float8 import Float8Linear, Float8LinearConfig
from fsdp_float8.core.numerics import sqnr_db

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8")
MODES = ("eager", "compile")


@dataclass(frozen=True)
class Shape:
    name: str
    m: int
    k: int
    n: int

    @property
    def flops(self) -> int:
        return 6 * self.m * self.k * self.n


# Llama-3 layer shapes as (name, in_features K, out_features N).
LLAMA3_LAYERS = {
    "8b": [
        ("attn.wq/wo", 4096, 4096),
        ("attn.wk/wv", 4096, 1024),
        ("ffn.w1/w3", 4096, 14336),
        ("ffn.w2", 14336, 4096),
    ],
    "70b": [
        ("attn.wq/wo", 8192, 8192),
        ("attn.wk/wv", 8192, 1024),
        ("ffn.w1/w3", 8192, 28672),
        ("ffn.w2", 28672, 8192),
    ],
}


def llama_shapes(tokens: int, ffn_only: bool = False) -> list[Shape]:
    return [
        Shape(f"llama3_{size}.{name}", tokens, k, n)
        for size, layers in LLAMA3_LAYERS.items()
        for name, k, n in layers
        if not ffn_only or name.startswith("ffn")
    ]


def shapes_for(preset: str, tokens: int | None) -> list[Shape]:
    """A preset name, or explicit shapes 'MxKxN,MxKxN'."""
    if preset == "quick":
        return [Shape("tiny", 32, 64, 128), Shape("tiny_t", 64, 128, 64)]
    if preset == "cpu":
        m = tokens or 512
        return [
            Shape("square_1k", m, 1024, 1024),
            Shape("up_1k_4k", m, 1024, 4096),
            Shape("down_4k_1k", m, 4096, 1024),
            Shape("llama3_8b.attn.wk/wv", tokens or 256, 4096, 1024),
        ]
    if preset in ("llama", "llama_ffn"):
        return llama_shapes(tokens or 16384, ffn_only=preset == "llama_ffn")
    try:
        shapes = []
        for spec in preset.split(","):
            m, k, n = (int(v) for v in spec.lower().split("x"))
            shapes.append(Shape(f"{m}x{k}x{n}", m, k, n))
        return shapes
    except ValueError:
        raise SystemExit(
            f"--shapes {preset!r}: expected quick, cpu, llama, llama_ffn or 'MxKxN,...' "
            "(e.g. 16384x4096x14336)"
        ) from None


def _step(layer: nn.Module, x: torch.Tensor, grad_output: torch.Tensor):
    params = list(layer.parameters())

    def step() -> None:
        x.grad = None
        for p in params:
            p.grad = None
        layer(x).backward(grad_output)

    return step


def _layer(base: nn.Linear, recipe: str | None, mode: str) -> nn.Module:
    layer: nn.Module = base
    if recipe is not None:
        layer = Float8Linear.from_float(base, Float8LinearConfig.from_recipe_name(recipe))
    if mode == "compile":
        reset_compiler()
        layer = torch.compile(layer)
    return layer


def run_case(base, recipe, mode, x, grad_output, device, args) -> dict:
    """Time one (layer, mode); also its output, for the SQNR column, and with `--kernels`
    the GEMM / other split of one more step."""
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


def _tflops(flops: int, ms: float | None) -> float | None:
    return flops / (ms * 1e-3) / 1e12 if ms else None


def bench_shape(shape: Shape, args, device, peaks, on_row=None) -> list[dict]:
    """bf16 and each recipe on one shape; `on_row(row)` after each row (the caller writes
    its JSON there, so a run cut short keeps every row it measured)."""
    torch.manual_seed(0)
    base = nn.Linear(shape.k, shape.n, bias=False, device=device, dtype=torch.bfloat16)
    x = torch.randn(shape.m, shape.k, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_output = torch.randn(shape.m, shape.n, device=device, dtype=torch.bfloat16)
    rows = []
    for mode in args.modes:
        ref = run_case(base, None, mode, x, grad_output, device, args)
        for recipe in args.recipes:
            res = run_case(base, recipe, mode, x, grad_output, device, args)
            bf16_ms, f8_ms = ref["median_ms"], res["median_ms"]
            row = {
                "shape": shape.name,
                "M": shape.m,
                "K": shape.k,
                "N": shape.n,
                "mode": mode,
                "recipe": recipe,
                "bf16_ms": bf16_ms,
                "float8_ms": f8_ms,
                "float8_min_ms": res.get("min_ms"),
                "speedup": bf16_ms / f8_ms if bf16_ms and f8_ms else None,
                "bf16_tflops": _tflops(shape.flops, bf16_ms),
                "float8_tflops": _tflops(shape.flops, f8_ms),
                "output_sqnr_db": (
                    sqnr_db(ref["output"], res["output"])
                    if ref["output"] is not None and res["output"] is not None
                    else None
                ),
                "error": ref["error"] or res["error"],
            }
            if args.kernels:
                row["bf16_split"], row["float8_split"] = ref.get("split"), res.get("split")
            if peaks:
                row["bf16_pct_peak"] = _pct(row["bf16_tflops"], peaks["bf16"])
                row["float8_pct_peak"] = _pct(row["float8_tflops"], peaks.get("fp8"))
            rows.append(row)
            print(_progress(row), flush=True)
            if on_row is not None:
                on_row(row)
    return rows


def _pct(tflops: float | None, peak: float | None) -> float | None:
    return 100 * tflops / peak if tflops is not None and peak else None


def _progress(row: dict) -> str:
    text = (
        f"{row['shape']} {row['M']}x{row['K']}x{row['N']} {row['mode']} {row['recipe']}: "
        f"bf16 {fmt(row['bf16_ms'])} ms, float8 {fmt(row['float8_ms'])} ms, "
        f"speedup {fmt(row['speedup'])}"
    )
    return text + (f" [{row['error']}]" if row["error"] else "")


def table(rows: list[dict], peaks) -> str:
    headers = ["shape", "M x K x N", "mode", "recipe", "bf16 ms", "float8 ms", "speedup"]
    headers += ["out SQNR dB"]
    if peaks:
        headers += ["bf16 TFLOP/s (% peak)", "float8 TFLOP/s (% fp8 peak)"]
    splits = any("float8_split" in r for r in rows)
    if splits:
        headers += ["bf16 GEMM / other ms", "float8 GEMM / other ms", "float8 kernels"]
    headers += ["error"]
    body = []
    for r in rows:
        line = [r["shape"], f"{r['M']}x{r['K']}x{r['N']}", r["mode"], r["recipe"]]
        line += [fmt(r["bf16_ms"], ".3f"), fmt(r["float8_ms"], ".3f"), fmt(r["speedup"])]
        line += [fmt(r["output_sqnr_db"], ".1f")]
        if peaks:
            line += [
                f"{fmt(r['bf16_tflops'], '.0f')} ({fmt(r.get('bf16_pct_peak'), '.0f')}%)",
                f"{fmt(r['float8_tflops'], '.0f')} ({fmt(r.get('float8_pct_peak'), '.0f')}%)",
            ]
        if splits:
            line += [_split(r.get("bf16_split")), _split(r.get("float8_split"))]
            line += [fmt((r.get("float8_split") or {}).get("kernels"), "d")]
        line += [r["error"] or ""]
        body.append(line)
    return markdown_table(headers, body)


def _split(split: dict | None) -> str:
    if not split:
        return "-"
    return f"{fmt(split['gemm_ms'], '.3f')} / {fmt(split['other_ms'], '.3f')}"


class OpCensus(TorchDispatchMode):
    """Counts the aten ops of a region by what they do to a float8 linear's cost."""

    def __init__(self, small_numel: int) -> None:
        super().__init__()
        self.small = small_numel  # at most this many elements: a scale, not an operand
        self.ops: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops[str(func)] += 1
        self.kinds[self._kind(func, args, kwargs)] += 1
        return out

    def _kind(self, func, args, kwargs) -> str:
        name = func.overloadpacket.__name__
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name == "_local_scalar_dense":
            return "host reads (.item())"
        if name in ("_scaled_mm", "mm", "addmm"):
            return "GEMMs"
        if first is None or first.numel() <= self.small:
            return "small ops (scales)"
        if name in ("amax", "amin", "aminmax", "max", "linalg_vector_norm", "_foreach_norm"):
            return "amax reductions"
        if name == "_to_copy" and kwargs.get("dtype", first.dtype).itemsize == 1:
            return "float8 casts (writes)"
        if first.dtype.itemsize == 1 and name in ("clone", "contiguous", "_to_copy"):
            return "float8 layout copies (transposes)"
        if name in ("_to_copy", "mul", "mul_", "clamp", "clamp_", "abs", "reciprocal", "div"):
            return "elementwise passes over operands"
        return "other"


def profile_recipes(shape: Shape, recipes: list[str], device) -> dict:
    """One eager forward + backward per recipe: op census and the profiler's top ops."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    base = nn.Linear(shape.k, shape.n, bias=False, device=device, dtype=torch.bfloat16)
    x = torch.randn(shape.m, shape.k, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_output = torch.randn(shape.m, shape.n, device=device, dtype=torch.bfloat16)
    report = {}
    for recipe in recipes:
        step = _step(_layer(base, recipe, "eager"), x, grad_output)
        step()
        with OpCensus(small_numel=max(shape.m, shape.n, shape.k)) as census:
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
        report[recipe] = {
            "kinds": dict(census.kinds.most_common()),
            "ops": dict(census.ops.most_common()),
            "top_self_cpu_ms": {e.key: e.self_cpu_time_total / 1e3 for e in top},
        }
    return report


def print_profile(shape: Shape, report: dict) -> None:
    print(f"\nop census, one forward + backward of {shape.m}x{shape.k}x{shape.n} (eager)")
    kinds = sorted({k for r in report.values() for k in r["kinds"]})
    rows = [[k] + [str(r["kinds"].get(k, 0)) for r in report.values()] for k in kinds]
    rows.append(["total aten ops"] + [str(sum(r["ops"].values())) for r in report.values()])
    print(markdown_table(["kind", *report], rows))
    for recipe, r in report.items():
        top = ", ".join(f"{k} {v:.1f}" for k, v in r["top_self_cpu_ms"].items())
        print(f"{recipe} top self-CPU ms: {top}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--shapes", default=None, help="quick | cpu | llama | llama_ffn | MxKxN,...")
    p.add_argument("--tokens", type=int, default=None, help="M for the presets")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipe names")
    p.add_argument("--compile", action="store_true", help="also run torch.compile'd layers")
    p.add_argument("--compile-only", action="store_true", help="only torch.compile'd layers")
    p.add_argument("--threads", type=int, default=None, help="CPU intra-op threads")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="tiny shapes, few iterations (smoke)")
    p.add_argument("--profile", action="store_true", help="op census + profiler, first shape")
    p.add_argument("--kernels", action="store_true", help="GEMM / other time split per case")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    args.recipes = parse_choices(p, args.recipes, RECIPES, "recipe(s)")
    if args.compile_only:
        args.modes = ["compile"]
    else:
        args.modes = ["eager", "compile"] if args.compile else ["eager"]
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = resolve_device(args.device, threads=args.threads)
    cuda = device.type == "cuda"
    preset = args.shapes or ("quick" if args.quick else "llama" if cuda else "cpu")
    shapes = shapes_for(preset, args.tokens)
    if args.warmup is None:
        args.warmup = 1 if args.quick or not cuda else 5
    if args.iters is None:
        args.iters = 2 if args.quick else 20 if cuda else 5
    peaks = peak_tflops(device)
    payload = {
        "benchmark": "linear",
        "environment": environment(device),
        "settings": {
            "shapes": preset,
            "modes": args.modes,
            "recipes": args.recipes,
            "warmup": args.warmup,
            "iters": args.iters,
            "dtype": "bfloat16",
            "step": "layer(x).backward(grad_output), 6*M*K*N FLOPs",
        },
        "peak_tflops": peaks,
        "results": [],
    }

    def on_row(row: dict) -> None:
        payload["results"].append(row)
        write_json(args.json, payload)

    for shape in shapes:
        bench_shape(shape, args, device, peaks, on_row)
    print()
    print(table(payload["results"], peaks))
    if args.profile:
        payload["profile"] = {"shape": vars(shapes[0])}
        payload["profile"] |= profile_recipes(shapes[0], args.recipes, device)
        print_profile(shapes[0], {r: payload["profile"][r] for r in args.recipes})
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
