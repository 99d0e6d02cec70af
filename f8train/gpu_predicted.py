"""Measured beside predicted: `bench_linear`'s compiled timings on a GPU against the roofline
of `count_kernels --gpu` for the same linears (docs/results.md, "GPU codegen").

    python -m f8train.gpu_predicted OUT/linear_compile.json [--predicted FILE]

FILE (default: f8train/gpu_predicted_h100.json, written on a CPU by
`python -m f8train.count_kernels --gpu h100 --shapes 16384x4096x14336,16384x8192x28672
--json f8train/gpu_predicted_h100.json`) holds, per linear and recipe, the roofline time of
one forward + backward: non-GEMM bytes at HBM bandwidth, GEMMs at the dense peak. The first
GPU run checks the model: the ratio column is measured / predicted (above 1: slower than the
roofline, as it must be; how much says what the model leaves out).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT = Path(__file__).with_name("gpu_predicted_h100.json")


def rows(measured: dict, predicted: dict) -> list[list[str]]:
    blocks = predicted["blocks"]
    out = []
    for r in measured.get("results", []):
        if r.get("mode") != "compile":
            continue
        shape = r["shape"]
        for name, recipe, key in (
            ("bf16", "bf16", "bf16_ms"),
            (r["recipe"], r["recipe"], "float8_ms"),
        ):
            label = f"{shape} bf16" if recipe == "bf16" else f"{shape} fsdp_float8 {recipe}"
            pred = blocks.get(label, {}).get("roofline_s")
            ms = r.get(key)
            cells = [shape, name, "-" if ms is None else f"{ms:.3f}"]
            cells.append("-" if pred is None else f"{pred * 1e3:.3f}")
            cells.append(f"{ms / (pred * 1e3):.2f}" if ms and pred else "-")
            out.append(cells)
    return out


def main(argv: list[str] | None = None) -> list[list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("measured", help="bench_linear's --json output (compiled rows are read)")
    p.add_argument("--predicted", default=str(DEFAULT), help="count_kernels --gpu's --json")
    args = p.parse_args(argv)
    measured = json.loads(Path(args.measured).read_text())
    predicted = json.loads(Path(args.predicted).read_text())
    table = rows(measured, predicted)
    seen: set = set()
    table = [r for r in table if not (tuple(r[:2]) in seen or seen.add(tuple(r[:2])))]
    headers = ["linear MxKxN", "recipe", "measured ms", f"predicted ms ({predicted['gpu']})"]
    headers.append("measured / predicted")
    widths = [max(len(x) for x in col) for col in zip(headers, *table)]
    for line in [headers, *table]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |")
    return table


if __name__ == "__main__":
    main()
