"""Train several float8 configurations on the same data and seed and compare them.

Run from the repository root (unknown flags go to every `f8train.train` run):
    python -m f8train.compare                               # 2 CPU ranks, the default runs
    python -m f8train.compare --nproc 2 --steps 100 --configs bf16,tensorwise,delayed
    python -m f8train.compare --nproc 8 --device cuda --preset small --steps 2000
    python -m f8train.compare --runs OUT/train_bf16 OUT/train_float8 --json OUT/cmp.json

Each configuration trains into `OUT/NAME/` (docs/trainer.md); writes `OUT/compare.md` and
`OUT/loss_curves.png`. `--runs` trains nothing: it sets two finished or cut-short runs side
by side from their `metrics.jsonl` (no torch import: seconds after a GPU run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from f8train.plot_numerics import pyplot

CONFIGS: dict[str, list[str]] = {
    "bf16": ["--recipe", "off"],
    "tensorwise": ["--recipe", "tensorwise", "--fp8-all-gather"],
    "tensorwise-hp-all-gather": ["--recipe", "tensorwise", "--no-fp8-all-gather"],
    "rowwise": ["--recipe", "rowwise"],
    "delayed": ["--recipe", "tensorwise", "--scaling", "delayed", "--fp8-all-gather"],
    "blockwise": ["--recipe", "blockwise"],
    "mxfp8": ["--recipe", "mxfp8", "--fp8-all-gather"],
    "nvfp4": ["--recipe", "nvfp4", "--fp8-all-gather"],
    "nvfp4_4over6": ["--recipe", "nvfp4_4over6", "--fp8-all-gather"],
}
BASELINE = "bf16"
HEADERS = ["config", "final train loss (avg 10)", "val loss", "val vs bf16", "tokens/s"]
HEADERS += ["all-gather / step", "peak memory"]
# float8-only flags of f8train.train (a --recipe off run refuses them as ignored)
_FLOAT8_VALUE_FLAGS = ("--scaling", "--static-scales", "--delayed-history", "--float8-skip")
_FLOAT8_VALUE_FLAGS += ("--numerics-every",)
_FLOAT8_FLAGS = (*_FLOAT8_VALUE_FLAGS, "--fp8-all-gather", "--no-fp8-all-gather", "--emulate")
_FLOAT8_FLAGS += ("--no-precompute",)
# --runs: figure -> format; the first three also as the second run over the first
RUN_FIGURES = {"tokens_per_s": ",.0f", "mfu": ".3f", "peak_memory_gib": ".2f", "final_loss": ".4f"}


# flags of one mode (None: not given) and their defaults; the other mode refuses them
_TRAIN_DEFAULTS = {"nproc": 2, "configs": ",".join(CONFIGS), "out": "runs/compare"}
_TRAIN_DEFAULTS |= {"steps": 100, "rerun": False}
_RUNS_DEFAULTS = {"skip": 5, "json": None}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, help="ranks per run (torchrun; default 2)")
    p.add_argument("--configs", help=f"from {list(CONFIGS)} (default: all)")
    p.add_argument("--out", help="default runs/compare")
    p.add_argument("--steps", type=int, help="default 100")
    p.add_argument("--rerun", action="store_true", default=None, help="train again if finished")
    p.add_argument("--runs", nargs=2, metavar="DIR", help="compare two runs, train nothing")
    p.add_argument("--skip", type=int, help="--runs: steps left out of medians (default 5)")
    p.add_argument("--json", help="--runs: write the comparison here")
    args, train_args = p.parse_known_args(argv)
    mine, other = (
        (_RUNS_DEFAULTS, _TRAIN_DEFAULTS) if args.runs else (_TRAIN_DEFAULTS, _RUNS_DEFAULTS)
    )
    idle = [f"--{k}" for k in other if getattr(args, k) is not None]
    idle += train_args if args.runs else []  # without --runs they go to every training run
    if idle:
        mode = "--runs trains nothing" if args.runs else "without --runs, runs are trained"
        p.error(f"{', '.join(idle)} would be ignored ({mode}): drop them")
    for key, default in mine.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    if not args.runs:  # bench_common imports torch, which --runs does without
        from f8train.bench_common import parse_choices

        args.names = parse_choices(p, args.configs, CONFIGS, "--configs")
    return args, train_args


def train_command(name: str, args: argparse.Namespace, train_args: list[str]) -> list[str]:
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc)]
    run = ["--steps", str(args.steps), "--out", str(Path(args.out) / name)]
    run += ["--log-every", str(max(1, args.steps // 10))]
    if "off" in CONFIGS[name]:
        train_args = _without_float8_flags(train_args)
    return [sys.executable, *launch, "-m", "f8train.train", *CONFIGS[name], *run, *train_args]


def _without_float8_flags(train_args: list[str]) -> list[str]:
    """The flags passed on to every run, less those that act only on float8 layers."""
    kept, args = [], iter(train_args)
    for arg in args:
        if arg in _FLOAT8_VALUE_FLAGS:
            next(args, None)  # its value
        elif arg.partition("=")[0] not in _FLOAT8_FLAGS:
            kept.append(arg)
    return kept


def run_config(name: str, args: argparse.Namespace, train_args: list[str]) -> dict:
    """Train one configuration (or reuse a finished run with the same command)."""
    from f8train.checkpoint import aside_name
    from f8train.train_log import read_metrics

    out = Path(args.out) / name
    command = train_command(name, args, train_args)
    stamp = out / "compare_command.json"
    finished = (out / "summary.json").exists() and stamp.exists()
    if finished and not args.rerun and json.loads(stamp.read_text()) == command[1:]:
        print(f"== {name}: reusing the finished run in {out}", flush=True)
    else:
        if out.exists():  # another command's run, or an unfinished one: kept, renamed
            old = aside_name(out, "previous")
            out.rename(old)
            print(f"== {name}: the earlier run in {out} is kept as {old}", flush=True)
        out.mkdir(parents=True)
        print(f"== {name}: {' '.join(command)}", flush=True)
        result = subprocess.run(command)
        if result.returncode != 0:
            print(f"== {name}: failed with exit code {result.returncode}", flush=True)
            return {"name": name, "failed": result.returncode}
        stamp.write_text(json.dumps(command[1:]) + "\n")
    summary = json.loads((out / "summary.json").read_text())
    return {"name": name, "summary": summary, "metrics": read_metrics(out / "metrics.jsonl")}


def markdown_table(results: list[dict]) -> str:
    from f8train.train_log import fmt_bytes

    base = next((r["summary"] for r in results if r["name"] == BASELINE and "summary" in r), {})
    base_val, rows = base.get("val_loss"), []
    for r in results:
        if "summary" not in r:
            rows.append([r["name"], f"failed (exit {r['failed']})", *[""] * 5])
            continue
        s, val = r["summary"], r["summary"].get("val_loss")
        gap = f"{100 * (val - base_val) / base_val:+.2f}%" if val is not None and base_val else "-"
        loss, tokens = f"{s['final_loss_avg10']:.4f}", f"{s['tokens_per_s']:,.0f}"
        sizes = [fmt_bytes(s.get(k)) for k in ("all_gather_bytes_per_step", "peak_memory_bytes")]
        rows.append([r["name"], loss, _fmt(val, ".4f"), gap, tokens, *sizes])
    return _table(HEADERS, rows)


def _table(headers: list[str], rows: list[list]) -> str:
    lines = [headers, ["---"] * len(headers), *rows]
    return "".join(f"| {' | '.join(map(str, line))} |\n" for line in lines)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _not_a_run(run: Path) -> str | None:
    """Why ``run`` is not a folder of a trainer run with metrics (None: it is)."""
    if not run.is_dir():
        return "no such folder" if not run.exists() else "not a folder"
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        return "no metrics.jsonl in it (not an f8train.train --out, or no step has run)"
    try:
        metrics.read_text()
    except (OSError, UnicodeDecodeError) as err:
        return f"{metrics} cannot be read ({err})"
    return None


def run_figures(run_dir: str | Path, skip: int) -> dict:
    """Medians of tokens/s and MFU after the first `skip` steps (compilation, allocator
    warm-up), the peak memory of all steps, the last loss; None where no step has it."""
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


def compare_runs(run_dirs: list[str], skip: int, json_path: str | None = None) -> dict:
    """Two runs' figures as a table, the second over the first in the last row."""
    first, second = (run_figures(r, skip) for r in run_dirs)
    keys = list(RUN_FIGURES)[:3]
    ratio = {k: second[k] / first[k] if first[k] and second[k] is not None else None for k in keys}
    rows = [
        [r["run"], r["timed_steps"], *(_fmt(r[k], f) for k, f in RUN_FIGURES.items())]
        for r in (first, second)
    ]
    rows.append(["second / first", "", *(_fmt(v, ".3f") for v in ratio.values()), ""])
    print(_table(["run", "timed steps", "tokens/s", "MFU", "peak GiB", "final loss"], rows))
    payload = {"skip": skip, "runs": [first, second], "ratio": ratio}
    if json_path:
        Path(json_path).write_text(json.dumps(payload, indent=2) + "\n")
    return payload


def plot(results: list[dict], path: Path) -> bool:
    """Train loss per step (validation as dots) and, below, each run's train loss minus the
    bf16 run's at the same step (the curves overlap at this scale); False without matplotlib."""
    try:
        plt = pyplot()
    except ImportError as e:
        print(f"{e}; no loss-curve PNG", flush=True)
        return False
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(2, 1))
    base = next((r for r in results if r["name"] == BASELINE and "metrics" in r), None)
    base_loss = {m["step"]: m["loss"] for m in base["metrics"]} if base else {}
    for r in (r for r in results if "metrics" in r):
        metrics = r["metrics"]
        steps = [m["step"] for m in metrics]
        line = top.plot(steps, [m["loss"] for m in metrics], label=r["name"], lw=1)[0]
        val = [(m["step"], m["val_loss"]) for m in metrics if "val_loss" in m]
        if val:
            top.plot(*zip(*val), "o--", color=line.get_color(), ms=4, lw=0.8)
        diff = [
            (m["step"], m["loss"] - base_loss[m["step"]]) for m in metrics if m["step"] in base_loss
        ]
        if diff:
            bottom.plot(*zip(*diff), color=line.get_color(), lw=1)
    top.set(ylabel="loss (train: line, validation: dots)", yscale="log")
    bottom.set(xlabel="step", ylabel=f"train loss - {BASELINE}")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    args, train_args = parse_args(argv)
    if args.runs:
        for run in args.runs:
            if (why := _not_a_run(Path(run))) is not None:
                print(f"f8train.compare: error: --runs {run}: {why}", file=sys.stderr)
                return 2
        compare_runs(args.runs, args.skip, args.json)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [run_config(name, args, train_args) for name in args.names]
    table = markdown_table(results)
    (out / "compare.md").write_text(table)
    print(f"\n{table}\nwrote {out / 'compare.md'}", flush=True)
    if plot(results, out / "loss_curves.png"):
        print(f"wrote {out / 'loss_curves.png'}", flush=True)
    return 1 if any("failed" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
