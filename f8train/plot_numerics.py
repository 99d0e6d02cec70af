"""Heatmaps of float8 numerics telemetry: one row per layer operand, one column per step.

Run (from the repository root; needs the `plot` extra: pip install -e '.[plot]'):
    python -m f8train.plot_numerics METRICS.jsonl --out numerics.png
    python -m f8train.plot_numerics METRICS.jsonl --out numerics.png --panels saturation underflow

Input: JSONL lines as `Float8Telemetry.flush()` writes them (see
`fsdp_float8.tools.telemetry.RECORD_FIELDS`). Other lines (e.g. the training loop's per-step
metrics in the same file) are skipped. Rows are `layer.operand`: layers in the order they
first appear (the model's forward order), each as input, weight, grad_output, with `@gemm`
added where an operand was recorded for more than one GEMM (`all_casts=True`). Several records for one cell (gradient
accumulation microbatches) show their maximum. Panels: saturation and underflow fractions
(linear colour scale from 0 to the larger of the data's max and a small floor, so an
all-zero panel stays readable), and amax on a log10 scale. Grey cells: not recorded.
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
# colour-scale floor of the fraction panels: values below it still show as a faint colour
_FRACTION_FLOOR = 1e-3


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The telemetry records of a JSONL file (other lines skipped)."""
    records = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
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
    layer_order = {layer: i for i, layer in enumerate(dict.fromkeys(r["layer"] for r in records))}

    def row_key(r: dict[str, Any]) -> tuple:
        op = r["operand"]
        return (layer_order[r["layer"]], _OPERANDS.index(op) if op in _OPERANDS else 9, op)

    labels: dict[str, int] = {}
    for r in sorted(records, key=row_key):  # stable: a layer's GEMMs keep their order
        labels.setdefault(_label(r, multi=len(gemms[(r["layer"], r["operand"])]) > 1), len(labels))
    steps = sorted({int(r["step"]) for r in records})
    col = {s: i for i, s in enumerate(steps)}
    cells: dict[tuple[str, int], float] = {}
    for r in records:
        label = _label(r, multi=len(gemms[(r["layer"], r["operand"])]) > 1)
        value = r.get(stat)
        value = math.nan if value is None else float(value)
        key = (label, col[int(r["step"])])
        old = cells.get(key, math.nan)
        cells[key] = value if math.isnan(old) else max(old, value)
    grid = [[math.nan] * len(steps) for _ in labels]
    for (label, c), value in cells.items():
        grid[labels[label]][c] = value
    return list(labels), steps, grid


def _label(r: dict[str, Any], *, multi: bool) -> str:
    text = f"{r['layer']}.{r['operand']}"
    return f"{text}@{r['gemm']}" if multi and r.get("gemm") else text


def _import_pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "f8train.plot_numerics needs matplotlib, which is not installed; install the "
            "optional plot extra: pip install -e '.[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def render(records: list[dict[str, Any]], out: str | Path, panels=PANELS, title=None) -> Path:
    """Write the heatmap PNG (one panel per statistic, side by side); returns its path."""
    import numpy as np

    plt = _import_pyplot()
    if not records:
        raise ValueError("no float8 telemetry records to plot")
    labels, steps, _ = build_grid(records, panels[0])
    height = max(3.0, 0.22 * len(labels) + 1.5)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels) + 2, height), squeeze=False)
    for ax, stat in zip(axes[0], panels):
        _, _, grid = build_grid(records, stat)
        data = np.array(grid, dtype=float)
        if stat == "amax":
            with np.errstate(divide="ignore"):
                data = np.log10(data)
            vmin, vmax, name = None, None, "log10 amax"
        else:
            finite = data[np.isfinite(data)]
            vmax = max(float(finite.max()) if finite.size else 0.0, _FRACTION_FLOOR)
            vmin, name = 0.0, f"{stat} fraction"
        cmap = plt.get_cmap("viridis" if stat == "amax" else "magma_r")
        cmap = cmap.with_extremes(bad="lightgrey")
        image = ax.imshow(
            np.ma.masked_invalid(data), aspect="auto", interpolation="nearest", cmap=cmap
        )
        image.set_clim(vmin, vmax)
        fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02)
        ax.set_title(name)
        ax.set_xlabel("step")
        _ticks(ax, labels, steps)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _ticks(ax, labels: list[str], steps: list[int]) -> None:
    every = max(1, math.ceil(len(steps) / 12))  # at most ~12 step labels
    ax.set_xticks(range(0, len(steps), every))
    ax.set_xticklabels([str(s) for s in steps[::every]], rotation=45, fontsize=7)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=7 if len(labels) < 40 else 5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", type=Path, help="JSONL file with Float8Telemetry records")
    p.add_argument("--out", type=Path, default=Path("numerics.png"), help="PNG to write")
    p.add_argument("--panels", nargs="+", choices=PANELS, default=list(PANELS))
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    records = read_records(args.metrics)
    if not records:
        print(
            f"error: no float8 telemetry records in {args.metrics} (expected JSON lines with "
            f"{', '.join(_TELEMETRY_KEYS)}, as Float8Telemetry.flush() returns)",
            file=sys.stderr,
        )
        return 2
    try:
        out = render(records, args.out, panels=tuple(args.panels), title=args.title)
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = len(build_grid(records, "saturation")[0])
    steps = len({r["step"] for r in records})
    print(f"wrote {out} ({rows} rows x {steps} steps, {len(records)} records)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
