"""Two training runs side by side from their per-step metrics: tokens/s, MFU, peak memory.

Run (from the repository root), e.g. on the runs of f8train/gpu_bench.sh:
    python -m f8train.train_compare OUT/train_bf16 OUT/train_float8 --json OUT/cmp.json

Each run's ``metrics.jsonl`` has a line per step; the first ``--skip`` steps (compilation,
allocator warm-up) are left out of the medians of tokens/s and MFU; peak memory is the
largest of all steps. A run cut short keeps the steps it finished; one with no timed step
is a row of dashes. The last row is the second run over the first. No torch import: this
runs in seconds after a GPU run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

KEYS = ("tokens_per_s", "mfu", "peak_memory_gib")


def run_figures(run_dir: str | Path, skip: int) -> dict:
    path = Path(run_dir) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    steps = [json.loads(line) for line in lines if line.strip()]
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


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("runs", nargs=2, help="two run directories (--out of f8train.train)")
    p.add_argument("--skip", type=int, default=5, help="first steps left out of the medians")
    p.add_argument("--json", default=None, help="write the comparison here")
    args = p.parse_args(argv)
    first, second = (run_figures(r, args.skip) for r in args.runs)
    ratio = {k: second[k] / first[k] if first[k] and second[k] is not None else None for k in KEYS}
    specs = {"tokens_per_s": ",.0f", "mfu": ".3f", "peak_memory_gib": ".2f", "final_loss": ".4f"}
    rows = [["run", "timed steps", "tokens/s", "MFU", "peak GiB", "final loss"]]
    for r in (first, second):
        figures = ["-" if r[k] is None else format(r[k], spec) for k, spec in specs.items()]
        rows.append([r["run"], str(r["timed_steps"]), *figures])
    rows.append(
        ["second / first", "", *("-" if v is None else f"{v:.3f}" for v in ratio.values()), ""]
    )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    print("\n".join([lines[0], "-+-".join("-" * w for w in widths), *lines[1:]]))
    payload = {"skip": args.skip, "runs": [first, second], "ratio": ratio}
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return payload


if __name__ == "__main__":
    main()
