"""Throughput of the float8 cast (amax + scale + saturating cast) against a plain copy.

Run (from the repository root):
    python -m f8train.bench_cast --compile                           # CPU, eager + compiled
    python -m f8train.bench_cast --device cuda --compile --json out/cast.json
    python -m f8train.bench_cast --quick --json /tmp/cast.json       # smoke test sizes

Mental model: a cast reads a bf16 tensor, reduces it to an amax (per tensor or per row),
turns the amax into a scale (`amax_to_scale`) and writes float8 data
(`cast_to_float8_data`), exactly as `Float8Linear` does for each operand. The memory-bound
limit for touching those bytes is a plain copy of the same source, `dst.copy_(src)`,
timed in the same run. `ratio = copy time / cast time` (1.0: the cast runs at copy
speed; a fused two-pass cast, amax then cast, cannot quite reach it). A cast allocates its
output (as in training); a second baseline row, `copy_alloc` (`src.clone()`), shows what
allocation costs at the same size (on CPU, blocks of 32 MiB and up come fresh from the OS,
page faults included, so there the allocating copy is far below `copy_`). GB/s counts each
byte once: source read + destination written (a copy moves 4 bytes per bf16 element, a
float8 cast 3).

Cases: `tensorwise` (one scale), `rowwise` (per row along the last dim, power-of-2 scales,
as the rowwise recipe casts input and weight for the output GEMM), `rowwise_dim0` (per
column: the grad_weight GEMM's operands), `cast_only` (a given scale: what the FSDP2
float8 all-gather does after `precompute_float8_dynamic_scale_for_fsdp`), `convert_only`
(`src.to(float8)`, no scale, no clamp: not a usable cast, but the floor that the dtype
conversion alone sets; a CPU without float8 conversion instructions sits far below copy
speed here whatever the cast does), `amax` (`tensor_amax`: the reduction alone, reads 2
bytes per element), `amax_vector_norm` (the same value by `linalg.vector_norm(inf)`,
kept to show why `tensor_amax` uses aminmax: 10x+ slower on CPU in eager). Modes: `eager`,
`compile` (torch.compile, inductor; its output is checked bit for bit against eager).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from f8train.bench_common import (
    environment,
    fmt,
    markdown_table,
    parse_choices,
    reset_compiler,
    resolve_device,
    short_error,
    time_ms,
    write_json,
)
from fsdp_float8.core.scaling import (
    Axiswise,
    DynamicScaling,
    Tensorwise,
    amax_to_scale,
    cast_to_float8_data,
    tensor_amax,
)

E4M3 = torch.float8_e4m3fn


def _dynamic_cast(strategy: DynamicScaling, dim: int) -> Callable:
    def cast(hp: torch.Tensor):
        scale = strategy.scale(hp, dim, E4M3)
        return cast_to_float8_data(hp, scale, E4M3), scale

    return cast


def _cast_only(hp: torch.Tensor, scale: torch.Tensor):
    return cast_to_float8_data(hp, scale, E4M3), scale


def _convert_only(hp: torch.Tensor, scale: torch.Tensor):
    # not a usable cast (no scaling, no saturation): the floor set by the conversion itself
    return hp.to(E4M3), scale


def _amax_vector_norm(hp: torch.Tensor):
    return torch.linalg.vector_norm(hp, float("inf")).to(torch.float32)


CASTS: dict[str, Callable] = {
    "tensorwise": _dynamic_cast(DynamicScaling(Tensorwise()), -1),
    "rowwise": _dynamic_cast(DynamicScaling(Axiswise(), power_of_2=True), -1),
    "rowwise_dim0": _dynamic_cast(DynamicScaling(Axiswise(), power_of_2=True), 0),
    "cast_only": _cast_only,
    "convert_only": _convert_only,
    "amax": tensor_amax,
    "amax_vector_norm": _amax_vector_norm,
}
_READ_ONLY = ("amax", "amax_vector_norm")  # bytes moved: the source read, 2 per element
_GIVEN_SCALE = ("cast_only", "convert_only")
SIZES = {
    "quick": [(256, 512)],
    "cpu": [(2048, 4096), (4096, 4096)],
    # Llama-3 operands: 8B activations (16384 tokens x 4096), 8B w1 (14336 x 4096),
    # 70B w2 (8192 x 28672).
    "cuda": [(16384, 4096), (14336, 4096), (8192, 28672)],
}


def _equal(a, b) -> bool:
    """Bit-equal outputs: float8 data compared as bytes, scales exactly."""
    if isinstance(a, torch.Tensor):  # an amax alone
        return torch.equal(a, b)
    (da, sa), (db, sb) = a, b
    return torch.equal(da.view(torch.uint8), db.view(torch.uint8)) and torch.equal(sa, sb)


def bench_size(rows: int, cols: int, args, device, on_row=None) -> list[dict]:
    """The cast cases of one (rows, cols) bf16 tensor; `on_row(row)` after each row (the
    caller writes its JSON there, so a run cut short keeps every row it measured)."""
    torch.manual_seed(0)
    src = torch.randn(rows, cols, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    numel = src.numel()
    results: list[dict] = []

    def add(row: dict) -> None:
        results.append(row)
        print(_progress(row), flush=True)
        if on_row is not None:
            on_row(row)

    copy = time_ms(lambda: dst.copy_(src), device, warmup=args.warmup, iters=args.iters)
    add(_row("copy", "eager", rows, cols, copy, 4 * numel, copy, None, None))
    clone = time_ms(src.clone, device, warmup=args.warmup, iters=args.iters)
    add(_row("copy_alloc", "eager", rows, cols, clone, 4 * numel, copy, None, None))
    given_scale = amax_to_scale(src.abs().amax().float(), E4M3)
    for mode in args.modes:
        for name in args.cases:
            call_args = (src, given_scale) if name in _GIVEN_SCALE else (src,)
            timing, equal, error = time_case(CASTS[name], call_args, mode, device, args)
            nbytes = (2 if name in _READ_ONLY else 3) * numel
            add(_row(name, mode, rows, cols, timing, nbytes, copy, equal, error))
    return results


def _writer(payload: dict, path: str | None):
    def on_row(row: dict) -> None:
        payload["results"].append(row)
        write_json(path, payload)

    return on_row


def time_case(fn: Callable, call_args: tuple, mode: str, device, args):
    """(timing, bit-equal to eager or None, error or None) of one cast."""
    equal = None
    try:
        if mode == "compile":
            reset_compiler()
            compiled = torch.compile(fn)
            equal = _equal(compiled(*call_args), fn(*call_args))
            fn = compiled
        timing = time_ms(lambda: fn(*call_args), device, warmup=args.warmup, iters=args.iters)
        return timing, equal, None
    except Exception as exc:  # a row with the error, not the end of the run
        return {}, equal, short_error(exc)


def _row(case, mode, rows, cols, timing, nbytes, copy, equal, error) -> dict:
    ms, cpu_ms = timing.get("median_ms"), timing.get("cpu_median_ms")
    return {
        "case": case,
        "mode": mode,
        "shape": [rows, cols],
        "src_dtype": "bfloat16",
        "median_ms": ms,
        "min_ms": timing.get("min_ms"),
        "bytes": nbytes,
        "gbps": nbytes / (ms * 1e-3) / 1e9 if ms else None,
        "copy_ms": copy["median_ms"],
        "ratio_vs_copy": copy["median_ms"] / ms if ms else None,
        # CPU only: the same ratio on process CPU time (robust to a busy shared machine)
        "cpu_ms": cpu_ms,
        "cpu_ratio_vs_copy": copy["cpu_median_ms"] / cpu_ms if cpu_ms else None,
        "bit_equal_to_eager": equal,
        "error": error,
    }


def _progress(r: dict) -> str:
    text = (
        f"{r['shape'][0]}x{r['shape'][1]} {r['case']} {r['mode']}: {fmt(r['median_ms'], '.3f')} "
        f"ms, {fmt(r['gbps'], '.1f')} GB/s, ratio vs copy {fmt(r['ratio_vs_copy'])}"
    )
    return text + (f" [{r['error']}]" if r["error"] else "")


def table(rows: list[dict]) -> str:
    cpu = any(r["cpu_ms"] is not None for r in rows)
    headers = ["shape", "case", "mode", "ms", "GB/s", "ratio vs copy"]
    headers += ["CPU-time ms", "CPU-time ratio"] if cpu else []
    headers += ["bit-equal eager", "error"]
    body = []
    for r in rows:
        line = [f"{r['shape'][0]}x{r['shape'][1]}", r["case"], r["mode"]]
        line += [fmt(r["median_ms"], ".3f"), fmt(r["gbps"], ".1f"), fmt(r["ratio_vs_copy"])]
        line += [fmt(r["cpu_ms"], ".3f"), fmt(r["cpu_ratio_vs_copy"])] if cpu else []
        line += ["-" if r["bit_equal_to_eager"] is None else str(r["bit_equal_to_eager"])]
        body.append(line + [r["error"] or ""])
    return markdown_table(headers, body)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--sizes", default=None, help="RxC,RxC (default: per device)")
    p.add_argument("--cases", default=",".join(CASTS), help="comma-separated cast cases")
    p.add_argument("--compile", action="store_true", help="also torch.compile the casts")
    p.add_argument("--threads", type=int, default=None, help="CPU intra-op threads")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="tiny sizes, few iterations (smoke)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    args.cases = parse_choices(p, args.cases, CASTS, "case(s)")
    args.modes = ["eager", "compile"] if args.compile else ["eager"]
    return args


def _sizes(spec: str | None, quick: bool, device: torch.device) -> list[tuple[int, int]]:
    if spec is None:
        return SIZES["quick" if quick else device.type]
    try:
        return [tuple(int(v) for v in s.lower().split("x")) for s in spec.split(",")]
    except ValueError:
        raise SystemExit(f"--sizes {spec!r}: expected 'RxC,RxC', e.g. 8192x4096") from None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = resolve_device(args.device, threads=args.threads)
    cuda = device.type == "cuda"
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.iters = args.iters if args.iters is not None else (3 if args.quick else 50 if cuda else 10)
    payload = {
        "benchmark": "cast",
        "environment": environment(device),
        "settings": {
            "modes": args.modes,
            "cases": args.cases,
            "warmup": args.warmup,
            "iters": args.iters,
            "float8_dtype": str(E4M3),
            "ratio": "copy_ms / cast_ms for the same bf16 source",
        },
        "results": [],
    }
    for rows, cols in _sizes(args.sizes, args.quick, device):
        bench_size(rows, cols, args, device, on_row=_writer(payload, args.json))
    print()
    print(table(payload["results"]))
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
