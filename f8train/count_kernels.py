"""How heavy the float8 hot path is: compiled kernels and eager ops, side by side.

Run (from the repository root; no torchrun: the eager part spawns its own 2 CPU ranks):
    python -m f8train.count_kernels                       # both tables, every recipe
    python -m f8train.count_kernels --compiled --recipes tensorwise,rowwise
    python -m f8train.count_kernels --eager --json /tmp/counts.json
    python -m f8train.count_kernels --gpu h100             # GPU codegen: torch 2.11 CUDA build

Two clock-free counts of the work around the GEMMs
Two clock-free counts of the work around the GEMMs, for bf16, this library per recipe and
torchao's float8 where it imports: inductor's kernels for one SwiGLU block, forward +
backward, and the non-view aten ops of one steady FSDP2 step on 2 gloo ranks (`top` as a
dispatch mode sees them, `deep` inside the float8 subclasses too). For that step also the
bytes the `deep` ops other than GEMMs and collectives write, in MB (10^6 bytes) per rank:
fresh outputs and in-place targets, no views (`op_counter.written_bytes`).

`--gpu h100|b200` instead lowers the SwiGLU block as Inductor does for that GPU (on a CPU,
with the CUDA build of torch 2.11: f8train/gpu_codegen.py) at a small shape and at Llama-3
8B's (dim 4096, hidden 14336, 8,192 tokens): Triton launches forward / backward, the bytes
Inductor estimates its non-GEMM kernels move, GEMM FLOPs by dtype, and a roofline time of
the block's forward + backward (`gpu_kernels.roofline_seconds`) with its speedup over bf16.
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
    markdown_table,
    parse_choices,
    short_error,
    torchao_error,
    write_json,
)
from f8train.bench_fsdp import AG, PRESETS, build, convert, train_step
from f8train.model import FeedForward
from f8train.op_counter import OpCounter
from f8train.rank_exit import exit_rank
from fsdp_float8 import CastConfig, Float8LinearConfig, convert_to_float8_training

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


GPU_RECIPES = {
    "h100": ("tensorwise", "delayed", "rowwise", "rowwise_with_gw_hp", "blockwise"),
    "b200": ("tensorwise", "delayed", "rowwise", "mxfp8", "nvfp4"),
}
# "delayed": tensorwise with delayed scaling of input, weight and grad_output, as a run
# compiles it from the step after its first sync (`gpu_kernels.as_after_first_sync`);
# compared with torchao's tensorwise (torchao 0.18 has no delayed scaling)
DELAYED = "delayed"
GPU_SHAPES = {  # one SwiGLU block: dim, hidden, tokens
    "small": (256, 768, 2048),
    "llama3_8b": (4096, 14336, 8192),
}
# what gpu_bench.sh times compiled (bench_linear --compile-only): one linear, MxKxN
GPU_LINEARS = ("16384x4096x14336", "16384x8192x28672")


def _gemm_flops(recipe: str, linears: list[tuple[int, int, int]]) -> dict[str, float]:
    """FLOPs of the 3 GEMMs of each (M, K, N) linear by the dtype they run in."""
    per_gemm = sum(2.0 * m * k * n for m, k, n in linears)
    low = {"bf16": "bf16", "nvfp4": "fp4"}.get(recipe, "fp8")
    flops = {low: 2 * per_gemm}  # output and grad_input
    grad_weight = "bf16" if recipe in ("bf16", "rowwise_with_gw_hp") else low
    flops[grad_weight] = flops.get(grad_weight, 0.0) + per_gemm
    return flops


def _gpu_model(shape: str) -> tuple[torch.nn.Module, tuple[int, int], list]:
    """`shape` ("small", "llama3_8b" or "MxKxN"): the bf16 model on meta, its input's
    shape, and its linears' (M, K, N)."""
    if shape in GPU_SHAPES:
        dim, hidden, tokens = GPU_SHAPES[shape]
        model: torch.nn.Module = FeedForward(dim, hidden)
        linears = [(tokens, dim, hidden)] * 2 + [(tokens, hidden, dim)]
        return model, (tokens, dim), linears
    m, k, n = (int(v) for v in shape.split("x"))
    # in a container: the conversion swaps a model's children, not the model itself
    return torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)), (m, k), [(m, k, n)]


def gpu_block_counts(gpu: str, lib: str, recipe: str, shape: str, cubin: bool = False) -> dict:
    """The SwiGLU block at `shape` (or one linear, "MxKxN"), converted by `lib` per `recipe`
    ("bf16": not converted), lowered for `gpu`: launches, non-GEMM bytes, GEMM FLOPs and
    the roofline time of its forward + backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from f8train import gpu_codegen as gc
    from f8train import gpu_kernels as gk
    from fsdp_float8 import NVFP4Config

    with gc.gpu_codegen(gpu, cubin=cubin) as log:
        with torch.device("meta"):
            model, x_shape, linears = _gpu_model(shape)
            model = model.to(torch.bfloat16)
        if recipe == "nvfp4":
            convert_to_float8_training(model, config=NVFP4Config())
        elif recipe == DELAYED:
            delayed = CastConfig(scaling_type="delayed")
            config = Float8LinearConfig(
                cast_config_input=delayed,
                cast_config_weight=delayed,
                cast_config_grad_output=delayed,
            )
            convert_to_float8_training(model, config=config)
        elif recipe != "bf16":
            convert(model, lib, recipe, module_filter_fn=None)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = model.to_empty(device="cuda")
            x = torch.empty(x_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        if recipe == DELAYED:
            gk.as_after_first_sync(model)
        torch.compile(model, backend=gc.codegen_backend(log), fullgraph=True)(x)
    graphs = {g.kind: g for g in gk.summaries(log)}
    if len(log.dynamo_graphs) != 1 or set(graphs) != {"forward", "backward"}:
        raise RuntimeError(f"{len(log.dynamo_graphs)} graphs: {sorted(graphs)}")
    fwd, bwd = graphs["forward"], graphs["backward"]
    flops = _gemm_flops(recipe, linears)
    nongemm = fwd.triton_bytes + bwd.triton_bytes
    return {
        "triton_fwd": fwd.triton,
        "triton_bwd": bwd.triton,
        "gemms": dict(fwd.gemms + bwd.gemms),
        "other_launches": sorted(
            op for g in (fwd, bwd) for op in g.extern + g.fallback if op not in g.gemms
        ),
        "nongemm_bytes": nongemm,
        "gemm_flops": flops,
        "roofline_s": gk.roofline_seconds(gpu, nongemm, flops),
    }


def _gpu_cases(gpu: str, recipes: list[str], ao_error: str | None) -> list[tuple[str, str]]:
    cases = [("ours", "bf16")]
    for recipe in recipes:
        cases.append(("ours", recipe))
        if recipe in TORCHAO_RECIPES and ao_error is None:
            cases.append(("torchao", recipe))
    return cases


def gpu_table(gpu: str, recipes: list[str], shapes: list[str], ao_error, cubin=False) -> dict:
    results: dict = {}
    for shape in shapes:
        for lib, recipe in _gpu_cases(gpu, recipes, ao_error):
            label = f"{shape} {_label(lib, recipe).replace(' (float8 all-gather)', '')}"
            try:
                results[label] = gpu_block_counts(gpu, lib, recipe, shape, cubin)
            except Exception as exc:  # reported in the table; the next case still runs
                results[label] = {"error": short_error(exc)}
            print(f"{gpu} {label}: {results[label]}", flush=True)
    return results


def gpu_markdown(gpu: str, results: dict) -> str:
    rows = []
    for label, r in results.items():
        if "error" in r:
            rows.append([label, r["error"], *["-"] * 7])
            continue
        shape = label.split(" ", 1)[0]
        base = results.get(f"{shape} bf16", {}).get("roofline_s")
        ao_label = label.replace("fsdp_float8 ", "torchao ", 1)
        theirs = results.get(ao_label.replace(f"torchao {DELAYED}", "torchao tensorwise"), {})
        vs = "-"
        if label.startswith(f"{shape} fsdp_float8 ") and "triton_fwd" in theirs:
            ours_n, ao_n = (
                r["triton_fwd"] + r["triton_bwd"],
                theirs["triton_fwd"] + theirs["triton_bwd"],
            )
            vs = f"{ours_n / ao_n:.2f}x / {r['nongemm_bytes'] / theirs['nongemm_bytes']:.2f}x"
        gemms = " ".join(f"{op} {n}" for op, n in sorted(r["gemms"].items()))
        flops = " + ".join(f"{f / 1e9:.1f} {d}" for d, f in sorted(r["gemm_flops"].items()))
        speedup = f"{base / r['roofline_s']:.2f}x" if base else "-"
        rows.append([
            label, f"{r['triton_fwd']} + {r['triton_bwd']}", gemms,
            f"{r['nongemm_bytes'] / 1e6:.1f}", vs, flops,
            f"{r['roofline_s'] * 1e6:.1f}", speedup,
        ])  # fmt: skip
    headers = ["", "Triton launches fwd + bwd", "GEMMs", "non-GEMM MB", "launches / MB vs torchao"]
    headers += ["GEMM GFLOP by dtype", f"roofline {gpu} (us)", "speedup vs bf16"]
    return markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> dict:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipes")
    p.add_argument("--compiled", action="store_true", help="only the compiled count")
    p.add_argument("--eager", action="store_true", help="only the eager count")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--gpu", choices=sorted(GPU_RECIPES), help="GPU codegen counts for this GPU")
    p.add_argument(
        "--shapes",
        default=",".join(GPU_SHAPES),
        help=f"with --gpu: SwiGLU blocks {sorted(GPU_SHAPES)} or single linears {GPU_LINEARS}",
    )
    p.add_argument("--cubin", action="store_true", help="with --gpu: build every cubin too")
    args = p.parse_args(argv)
    if args.gpu:
        return _gpu_main(p, args)
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


def _gpu_main(p, args) -> dict:
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")  # no CUDA driver here
    recipes = GPU_RECIPES[args.gpu]
    if args.recipes != ",".join(RECIPES):
        recipes = tuple(parse_choices(p, args.recipes, GPU_RECIPES[args.gpu], "recipe(s)"))
    shapes = parse_choices(p, args.shapes, (*GPU_SHAPES, *GPU_LINEARS), "shape(s)")
    ao_error = torchao_error()
    results = gpu_table(args.gpu, list(recipes), shapes, ao_error, args.cubin)
    date = datetime.date.today().isoformat()
    ao = ao_error or importlib.metadata.version("torchao")
    print(f"\n{date}, torch {torch.__version__}, GPU codegen for {args.gpu}; torchao: {ao}\n")
    print(gpu_markdown(args.gpu, results))
    payload = {"date": date, "torch": torch.__version__, "gpu": args.gpu, "torchao_error": ao_error}
    payload |= {"shapes": shapes, "blocks": results}
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
