"""Throughput of the float8 cast (amax + scale + saturating cast) against a plain copy.

Run (from the repository root):
    python -m f8train.bench_cast --compile                           # CPU, eager + compiled
    python -m f8train.bench_cast --device cuda --compile --json out/cast.json
    python -m f8train.bench_cast --quick --json /tmp/cast.json       # smoke test sizes

A case reads a bf16 tensor and writes e4m3 data as `Float8Linear` casts an operand: with
`tensorwise`, `rowwise` (power-of-2 scales), `rowwise_dim0` (per column, as grad_weight's
operands) or a given scale (`cast_only`); `amax` is the reduction alone. `ratio vs copy` =
`dst.copy_(src)`'s time in the same run / the case's; GB/s counts bytes read + written.
`--compile` rows are checked bit for bit against eager.
"""

from __future__ import annotations

import torch

from f8train.bench_common import (
    ERROR,
    Report,
    bench_parser,
    column,
    parse_choices,
    parse_dims,
    resolve_device,
    short_error,
    time_ms,
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


def _dynamic(strategy: DynamicScaling, dim: int):
    def cast(hp: torch.Tensor):
        scale = strategy.scale(hp, dim, E4M3)
        return cast_to_float8_data(hp, scale, E4M3), scale

    return cast


CASTS = {
    "tensorwise": _dynamic(DynamicScaling(Tensorwise()), -1),
    "rowwise": _dynamic(DynamicScaling(Axiswise(), power_of_2=True), -1),
    "rowwise_dim0": _dynamic(DynamicScaling(Axiswise(), power_of_2=True), 0),
    "cast_only": lambda hp, scale: (cast_to_float8_data(hp, scale, E4M3), scale),
    "amax": tensor_amax,
}
SIZES = {
    "quick": [(256, 512)],
    "cpu": [(2048, 4096), (4096, 4096)],
    # Llama-3 operands: 8B activations (16384 tokens x 4096), 8B w1, 70B w2
    "cuda": [(16384, 4096), (14336, 4096), (8192, 28672)],
}


def _equal(a, b) -> bool:
    """Bit-equal outputs: float8 data compared as bytes, scales (or an amax) exactly."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def _time_case(fn, call_args: tuple, mode: str, timing) -> tuple[dict, bool | None, str | None]:
    """(timing, bit-equal to eager or None, error or None) of one cast."""
    equal = None
    try:
        if mode == "compile":
            torch._dynamo.reset()  # each case compiled on its own
            compiled = torch.compile(fn)
            equal = _equal(compiled(*call_args), fn(*call_args))
            fn = compiled
        return timing(lambda: fn(*call_args)), equal, None
    except Exception as exc:  # a row with the error, not the end of the run
        return {}, equal, short_error(exc)


def _row(case, mode, src, copy: dict, timing: dict, equal=None, error=None) -> dict:
    ms, cpu_ms = timing.get("median_ms"), timing.get("cpu_median_ms")
    nbytes = src.numel() * {"copy": 4, "amax": 2}.get(case, 3)  # bytes read + written
    return {
        "case": case,
        "mode": mode,
        "shape": list(src.shape),
        "src_dtype": "bfloat16",
        "median_ms": ms,
        "min_ms": timing.get("min_ms"),
        "bytes": nbytes,
        "gbps": nbytes / (ms * 1e-3) / 1e9 if ms else None,
        "copy_ms": copy["median_ms"],
        "ratio_vs_copy": copy["median_ms"] / ms if ms else None,
        "cpu_ms": cpu_ms,  # CPU only: the ratio on process CPU time, robust to a busy machine
        "cpu_ratio_vs_copy": copy["cpu_median_ms"] / cpu_ms if cpu_ms else None,
        "bit_equal_to_eager": equal,
        "error": error,
    }


def bench_size(rows: int, cols: int, args, device, report: Report) -> None:
    torch.manual_seed(0)
    src = torch.randn(rows, cols, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)

    def timing(fn):
        return time_ms(fn, device, warmup=args.warmup, iters=args.iters)

    copy = timing(lambda: dst.copy_(src))
    report.add(_row("copy", "eager", src, copy, copy))
    given_scale = amax_to_scale(src.abs().amax().float(), E4M3)
    for mode in args.modes:
        for name in args.cases:
            call = (src, given_scale) if name == "cast_only" else (src,)
            report.add(_row(name, mode, src, copy, *_time_case(CASTS[name], call, mode, timing)))


def _columns(cpu: bool) -> list:
    cols = [("shape", lambda r: "x".join(map(str, r["shape"]))), column("case", "case")]
    cols += [column("mode", "mode"), column("ms", "median_ms", ".3f")]
    cols += [column("GB/s", "gbps", ".1f"), column("ratio vs copy", "ratio_vs_copy")]
    if cpu:
        cols += [column("CPU-time ms", "cpu_ms", ".3f")]
        cols += [column("CPU-time ratio", "cpu_ratio_vs_copy")]
    return cols + [column("bit-equal eager", "bit_equal_to_eager"), ERROR]


def main(argv: list[str] | None = None) -> dict:
    p = bench_parser(__doc__)
    p.add_argument("--sizes", default=None, help="RxC,RxC (default: per device)")
    p.add_argument("--cases", default=",".join(CASTS), help="comma-separated cast cases")
    p.add_argument("--compile", action="store_true", help="also torch.compile the casts")
    args = p.parse_args(argv)
    args.cases = parse_choices(p, args.cases, CASTS, "case(s)")
    args.modes = ["eager", "compile"] if args.compile else ["eager"]
    device = resolve_device(args.device, threads=args.threads)
    cuda = device.type == "cuda"
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.iters = args.iters if args.iters is not None else (3 if args.quick else 50 if cuda else 10)
    sizes = SIZES["quick" if args.quick else device.type]
    if args.sizes:
        sizes = parse_dims(p, "--sizes", args.sizes, 2)
    report = Report("cast", device, args, _columns(not cuda), float8_dtype=str(E4M3))
    for rows, cols in sizes:
        bench_size(rows, cols, args, device, report)
    return report.done()


if __name__ == "__main__":
    main()
