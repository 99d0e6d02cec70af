"""How heavy the float8 hot path is: compiled kernels and eager ops, side by side.

Run (from the repository root; no torchrun: the eager part spawns its own 2 CPU ranks):
    python -m f8train.count_kernels                       # both tables, every recipe
    python -m f8train.count_kernels --compiled --recipes tensorwise,rowwise
    python -m f8train.count_kernels --eager --json /tmp/counts.json

Two clock-free counts of the work around the GEMMs, for bf16, this library per recipe and
torchao's float8 where it imports: inductor's kernels for one SwiGLU block, forward +
backward, and the non-view aten ops of one steady FSDP2 step on 2 gloo ranks (`top` as a
dispatch mode sees them, `deep` inside the float8 subclasses too). For that step also the
bytes the `deep` ops other than GEMMs and collectives write, in MB (10^6 bytes) per rank:
fresh outputs and in-place targets, no views (`bench_common.written_bytes`).
docs/results.md says more.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import pickle
import tempfile
from pathlib import Path

import torch

from f8train.bench_common import (
    OpCounter,
    markdown_table,
    parse_choices,
    short_error,
    torchao_error,
    write_json,
)
from f8train.bench_fsdp import AG, PRESETS, build, convert, train_step
from f8train.model import FeedForward
from f8train.rank_exit import exit_rank

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8")
TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
BLOCK = dict(dim=512, hidden=1408, batch=4, seq=256)  # the compiled SwiGLU block
WORLD = 2


def compiled_kernel_count(lib: str, recipe: str) -> int:
    """Inductor kernels of the SwiGLU block's forward + backward (`recipe` "bf16": none)."""
    import torch._inductor.config as inductor_config
    import torch._inductor.metrics as metrics

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = FeedForward(BLOCK["dim"], BLOCK["hidden"]).to(torch.bfloat16)
    if recipe != "bf16":
        convert(model, lib, recipe, module_filter_fn=None)
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    x = torch.randn(BLOCK["batch"], BLOCK["seq"], BLOCK["dim"], dtype=torch.bfloat16)
    with inductor_config.patch(force_disable_caches=True):
        metrics.reset()
        compiled(x.requires_grad_()).float().sum().backward()
        count = metrics.generated_kernel_count
    torch._dynamo.reset()
    return count


def eager_step_ops(rank: int, world: int, lib: str, recipe: str) -> dict:
    """On one rank of an initialized gloo group: two warm-up steps, then one counted."""
    from torch.distributed.device_mesh import init_device_mesh

    cpu, preset = torch.device("cpu"), PRESETS["cpu"]
    mesh = init_device_mesh("cpu", (world,))
    # tensorwise gathers in float8 (both libraries); others with "+ag" (this library only)
    recipe, _, flag = recipe.partition("+")
    changes = AG if flag or recipe == "tensorwise" else {}
    run = build(preset, mesh, cpu, None if recipe == "bf16" else lib, recipe, **changes)
    if run.after_step is not None:
        run.after_step(run.model)
    losses = [train_step(run, preset, s, rank, cpu).item() for s in range(2)]
    with OpCounter() as counter:
        losses.append(train_step(run, preset, 2, rank, cpu).item())
    top, deep, written = dict(counter.top), dict(counter.deep), dict(counter.written)
    return {"top": top, "deep": deep, "written": written, "losses": losses}


def _eager_worker(rank: int, world: int, tmp: str, cases: list) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    results = {}
    for lib, recipe in cases:
        try:
            results[(lib, recipe)] = eager_step_ops(rank, world, lib, recipe)
        except Exception as exc:  # reported in the table; the next case still runs
            results[(lib, recipe)] = {"error": short_error(exc)}
        dist.barrier()
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, results)
    dist.destroy_process_group()
    if rank == 0:
        Path(tmp, "results.pkl").write_bytes(pickle.dumps(per_rank))
    exit_rank(0)  # no finalization, where a c10d thread can abort a finished rank


def eager_counts(cases: list[tuple[str, str]], world: int = WORLD) -> dict:
    """Spawn `world` CPU ranks, run every (lib, recipe) case, return rank 0's results
    (`ranks_agree`: whether every rank counted the same ops)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:  # a child's error is raised here with its rank
        mp.spawn(_eager_worker, args=(world, tmp, cases), nprocs=world)
        per_rank = pickle.loads(Path(tmp, "results.pkl").read_bytes())
    for key, result in per_rank[0].items():
        same = [o[key].get(k) == result.get(k) for o in per_rank for k in ("top", "written")]
        result["ranks_agree"] = all(same)
    return per_rank[0]


def _cases(recipes: list[str], ao_error: str | None) -> list[tuple[str, str]]:
    """(lib, recipe) rows; a recipe with "+ag" (eager only) gathers its weights in float8."""
    cases = [("ours", "bf16")]
    for recipe in recipes:
        cases.append(("ours", recipe))
        if recipe in TORCHAO_RECIPES and ao_error is None:
            cases.append(("torchao", recipe))
        if recipe.startswith("rowwise"):
            cases.append(("ours", recipe + "+ag"))
    return cases


def _label(lib: str, recipe: str) -> str:
    if recipe == "bf16":
        return "bf16"
    recipe, _, flag = recipe.partition("+")
    ag = " (float8 all-gather)" if recipe == "tensorwise" or flag else ""
    return f"{'fsdp_float8' if lib == 'ours' else 'torchao'} {recipe}{ag}"


def compiled_table(cases: list[tuple[str, str]]) -> dict:
    results = {}
    for lib, recipe in [c for c in cases if "+" not in c[1]]:  # "+ag" rows: eager only
        label = _label(lib, recipe)
        try:
            results[label] = compiled_kernel_count(lib, recipe)
        except Exception as exc:  # reported in the table; the next case still runs
            results[label] = short_error(exc)
        print(f"compiled {label}: {results[label]}", flush=True)
    return results


def eager_table(cases: list[tuple[str, str]]) -> dict:
    results = {}
    for key, r in eager_counts(cases).items():
        if "error" not in r:
            r = {
                "top": sum(r["top"].values()),
                "deep": sum(r["deep"].values()),
                "clone": r["top"].get("clone", 0),
                "nongemm_mb": sum(r["written"].values()) / 1e6,
                "written_by_op": r["written"],
                "by_op_top": r["top"],
                "by_op_deep": r["deep"],
                "final_loss": r["losses"][-1],
                "ranks_agree": r["ranks_agree"],
            }
        results[_label(*key)] = r
    return results


def _mb_cells(eager: dict, label: str) -> list:
    """Non-GEMM MB written, and on this library's rows ours / torchao's where both ran."""
    mb = eager.get(label, {}).get("nongemm_mb")
    theirs = eager.get(label.replace("fsdp_float8 ", "torchao ", 1), {}).get("nongemm_mb")
    ratio = "-"
    if label.startswith("fsdp_float8 ") and mb is not None and theirs:
        ratio = f"{mb:.2f} / {theirs:.2f} ({mb / theirs:.2f}x)"
    return ["-" if mb is None else f"{mb:.2f}", ratio]


def markdown(compiled: dict, eager: dict) -> str:
    rows = []
    for label in dict.fromkeys([*compiled, *eager]):
        e = eager.get(label, {})
        cells = [e.get("top", e.get("error", "-")), e.get("deep", "-"), e.get("clone", "-")]
        rows.append([label, compiled.get(label, "-"), *cells, *_mb_cells(eager, label)])
    headers = ["", "compiled kernels", "eager ops (top)", "eager ops (deep)", "eager clones"]
    headers += ["non-GEMM MB written", "MB ours / torchao"]
    return markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> dict:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipes")
    p.add_argument("--compiled", action="store_true", help="only the compiled count")
    p.add_argument("--eager", action="store_true", help="only the eager count")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    ao_error = torchao_error()
    cases = _cases(parse_choices(p, args.recipes, RECIPES, "recipe(s)"), ao_error)
    compiled = compiled_table(cases) if args.compiled or not args.eager else {}
    eager = eager_table(cases) if args.eager or not args.compiled else {}
    date = datetime.date.today().isoformat()
    ao = ao_error or importlib.metadata.version("torchao")
    print(f"\n{date}, torch {torch.__version__}, CPU; torchao: {ao}\n\n{markdown(compiled, eager)}")
    payload = {"date": date, "torch": torch.__version__, "torchao_error": ao_error}
    payload |= {"compiled": compiled, "eager": eager}
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
