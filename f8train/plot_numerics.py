"""Heatmaps of float8 numerics telemetry: one row per layer operand, one column per step.

Run (from the repository root; needs the `plot` extra: pip install -e '.[plot]'):
    python -m f8train.plot_numerics METRICS.jsonl --out numerics.png

Input: the JSONL lines of `Float8Telemetry.flush()` (other lines are skipped). Rows are
`layer.operand` in forward order, with `@gemm` where an operand was recorded for several
GEMMs; several records of one cell show their maximum. Panels: saturation and underflow
fractions (from 0 to at least 1e-3) and log10 amax; grey: not recorded.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

PANELS = ("saturation", "underflow", "amax")
_OPERANDS = ("input", "weight", "grad_output")
_TELEMETRY_KEYS = ("step", "layer", "operand", "saturation", "underflow", "amax")


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The telemetry records of a JSONL file (other lines skipped)."""
    records = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        try:
            obj = json.loads(line) if line.strip() else None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n} is not JSON ({e}); expected one object per line") from e
        if isinstance(obj, dict) and all(k in obj for k in _TELEMETRY_KEYS):
            records.append(obj)
    return records


def build_grid(records: list[dict[str, Any]], stat: str) -> tuple[list[str], list[int], list]:
    """(row labels, steps, rows x steps values with NaN for missing) for one statistic."""
    gemms: dict[tuple[str, str], set[str]] = {}
    for r in records:
        gemms.setdefault((r["layer"], r["operand"]), set()).add(r.get("gemm", ""))
    layers = {layer: i for i, layer in enumerate(dict.fromkeys(r["layer"] for r in records))}

    def label(r: dict[str, Any]) -> str:
        text = f"{r['layer']}.{r['operand']}"
        multi = len(gemms[(r["layer"], r["operand"])]) > 1
        return f"{text}@{r['gemm']}" if multi and r.get("gemm") else text

    def order(r: dict[str, Any]) -> tuple:
        op = r["operand"]
        return layers[r["layer"]], _OPERANDS.index(op) if op in _OPERANDS else 9, op

    rows: dict[str, int] = {}
    for r in sorted(records, key=order):  # stable: a layer's GEMMs keep their order
        rows.setdefault(label(r), len(rows))
    steps = sorted({int(r["step"]) for r in records})
    cols = {step: i for i, step in enumerate(steps)}
    grid = [[math.nan] * len(steps) for _ in rows]
    for r in records:
        row, col = grid[rows[label(r)]], cols[int(r["step"])]
        value = math.nan if r.get(stat) is None else float(r[stat])
        row[col] = value if math.isnan(row[col]) else max(row[col], value)
    return list(rows), steps, grid


def pyplot():
    """matplotlib's pyplot drawing to files, or an ImportError that says how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "matplotlib is not installed: install the plot extra with "
            "pip install -e '.[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def render(records: list[dict[str, Any]], out: str | Path) -> Path:
    """Write the heatmap PNG (one panel per statistic, side by side); returns its path."""
    import numpy as np

    plt = pyplot()
    labels, steps, _ = build_grid(records, PANELS[0])
    height = max(3.0, 0.22 * len(labels) + 1.5)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.5 * len(PANELS) + 2, height), squeeze=False)
    for ax, stat in zip(axes[0], PANELS):
        data = np.array(build_grid(records, stat)[2], dtype=float)
        if stat == "amax":
            with np.errstate(divide="ignore"):
                data = np.log10(data)
            vmin, vmax, name, cmap = None, None, "log10 amax", "viridis"
        else:
            finite = data[np.isfinite(data)]
            vmax = max(float(finite.max()) if finite.size else 0.0, 1e-3)
            vmin, name, cmap = 0.0, f"{stat} fraction", "magma_r"
        image = ax.imshow(
            np.ma.masked_invalid(data), aspect="auto", interpolation="nearest",
            cmap=plt.get_cmap(cmap).with_extremes(bad="lightgrey"),
        )  # fmt: skip
        image.set_clim(vmin, vmax)
        fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02)
        ax.set(title=name, xlabel="step")
        every = max(1, math.ceil(len(steps) / 12))  # at most ~12 step labels
        ax.set_xticks(range(0, len(steps), every), [str(s) for s in steps[::every]])
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=7 if len(labels) < 40 else 5)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"wrote {out} ({len(labels)} rows x {len(steps)} steps, {len(records)} records)")
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("metrics", type=Path, help="JSONL file with Float8Telemetry records")
    p.add_argument("--out", type=Path, default=Path("numerics.png"), help="PNG to write")
    args = p.parse_args(argv)
    records = read_records(args.metrics)
    try:
        if not records:
            raise ValueError(
                f"no float8 telemetry records in {args.metrics} (expected JSON lines with "
                f"{', '.join(_TELEMETRY_KEYS)}, as Float8Telemetry.flush() returns)"
            )
        render(records, args.out)
    except (ImportError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
