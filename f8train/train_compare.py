"""Two training runs side by side from their per-step metrics: tokens/s, MFU, peak memory.

Run (from the repository root), e.g. on the runs of f8train/gpu_bench.sh:
    python -m f8train.train_compare OUT/train_bf16 OUT/train_float8 --json OUT/cmp.json

Mental model: each run's ``metrics.jsonl`` has one line per step (f8train/train_log.py).
The first ``--skip`` steps (compilation, allocator warm-up) are left out; tokens/s and MFU
are medians over the rest, peak memory the largest over all steps. A run cut short by a
timeout still has the steps it finished, so this works on partial runs too; a run with no
timed step gives a row of dashes. The last row is the ratio of the second run to the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

# no torch import (nor f8train.bench_common's): this runs in seconds after a GPU run


def run_figures(run_dir: str | Path, skip: int) -> dict:
    path = Path(run_dir) / "metrics.jsonl"
    steps = []
    if path.exists():
        steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    timed = [s for s in steps if s.get("step", 0) > skip]
    mfus = [s["mfu"] for s in timed if s.get("mfu") is not None]
    mems = [s["peak_memory_bytes"] for s in steps if s.get("peak_memory_bytes") is not None]
    return {
        "run": str(run_dir),
        "steps": len(steps),
        "timed_steps": len(timed),
        "tokens_per_s": statistics.median(s["tokens_per_s"] for s in timed) if timed else None,
        "mfu": statistics.median(mfus) if mfus else None,
        "peak_memory_gib": max(mems) / 2**30 if mems else None,
        "final_loss": steps[-1]["loss"] if steps else None,
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    cells = [headers, *rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> float | None:
    return b / a if a and b is not None else None


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("runs", nargs=2, help="two run directories (--out of f8train.train)")
    p.add_argument("--skip", type=int, default=5, help="first steps left out of the medians")
    p.add_argument("--json", default=None, help="write the comparison here")
    args = p.parse_args(argv)
    first, second = (run_figures(r, args.skip) for r in args.runs)
    keys = ("tokens_per_s", "mfu", "peak_memory_gib")
    ratio = {k: _ratio(first[k], second[k]) for k in keys}
    rows = [
        [r["run"], str(r["timed_steps"]), _fmt(r["tokens_per_s"], ",.0f"), _fmt(r["mfu"], ".3f"),
         _fmt(r["peak_memory_gib"], ".2f"), _fmt(r["final_loss"], ".4f")]
        for r in (first, second)
    ]  # fmt: skip
    rows.append(["second / first", "", *(_fmt(ratio[k], ".3f") for k in keys), ""])
    headers = ["run", "timed steps", "tokens/s", "MFU", "peak GiB", "final loss"]
    print(_table(headers, rows))
    payload = {"skip": args.skip, "runs": [first, second], "ratio": ratio}
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return payload


if __name__ == "__main__":
    main()
