"""How heavy the float8 hot path is: compiled kernels and eager ops, side by side.

Run (from the repository root; no torchrun: the eager part spawns its own 2 CPU ranks):
    python -m f8train.count_kernels                       # both tables, every recipe
    python -m f8train.count_kernels --compiled --recipes tensorwise,rowwise
    python -m f8train.count_kernels --eager --json /tmp/counts.json

Mental model: float8 wins its time in the three GEMMs of a linear layer and loses it in the
work around them (amax, scale, cast, transposed copies). Two counts measure that work
without a clock, so they are deterministic and comparable on any machine:

- `compiled`: one SwiGLU block (`w2(silu(w1(x)) * w3(x))`, dim 512, hidden 1408, bf16,
  4x256 tokens) under `torch.compile(fullgraph=True)` with inductor, forward + backward:
  the kernels inductor generated (`torch._inductor.metrics.generated_kernel_count`; on the
  CPU one per loop nest, which is what would be one GPU kernel launch each). Caches are off
  so the number is always the generated one.
- `eager`: the non-view aten ops of one steady FSDP2 training step (forward, backward,
  optimizer step, the float8 scale refresh) on 2 gloo ranks, a small Llama
  (`f8train.model`, dim 256, 4 layers: 28 float8 linears), bf16 parameters and float8
  all-gather where the recipe has one; views do no work and are not counted (nor is
  `_unsafe_view`, a view that autograd does not track), but a `contiguous` or `reshape` that
  copied is. `top` is what a `TorchDispatchMode` sees (ops on a
  tensor subclass count once, whatever they run inside); `deep` also opens the float8
  tensor subclasses and counts the ops they run on their inner tensors (DTensor stays
  closed: it is the same for every column), so work hidden in a subclass counts too.

Columns: `bf16` (no float8), this library per recipe, and torchao's float8 (only when
`torchao.float8` imports: it is no dependency of this package) with the same recipe names.
torchao runs its real GEMM path (`emulate=False`), as this library does.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import sys
import tempfile
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from f8train.bench_common import markdown_table, short_error, write_json
from fsdp_float8.core.float8_ops import _cpu_scaled_mm

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8")
TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
BLOCK = dict(dim=512, hidden=1408, batch=4, seq=256)  # the compiled SwiGLU block
MODEL = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, seq=128, batch=4)  # eager step
WORLD = 2


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def torchao_error() -> str | None:
    """None when torchao's float8 imports, else why not."""
    try:
        import torchao.float8  # noqa: F401
    except Exception as exc:
        return short_error(exc)
    return None


def convert(
    model: nn.Module, lib: str, recipe: str, *, fp8_all_gather: bool = False, module_filter_fn=None
) -> None:
    """Convert `model` in place with `lib` ("ours" or "torchao") and a named recipe."""
    if lib == "torchao":
        import torchao.float8 as ao

        config = ao.Float8LinearConfig.from_recipe_name(recipe)
        if fp8_all_gather:
            config = _replace(config, enable_fsdp_float8_all_gather=True)
        ao.convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)
        return
    from fsdp_float8 import Float8LinearConfig, convert_to_float8_training

    extra = {"enable_fsdp_float8_all_gather": True} if fp8_all_gather else {}
    config = Float8LinearConfig.from_recipe_name(recipe, **extra)
    convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)


def _replace(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


def compiled_kernel_count(lib: str, recipe: str) -> int:
    """Inductor kernels of the SwiGLU block's forward + backward (`recipe` "bf16": none)."""
    import torch._inductor.config as inductor_config
    import torch._inductor.metrics as metrics

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SwiGLU(BLOCK["dim"], BLOCK["hidden"]).to(torch.bfloat16)
    if recipe != "bf16":
        convert(model, lib, recipe)
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    x = torch.randn(BLOCK["batch"], BLOCK["seq"], BLOCK["dim"], dtype=torch.bfloat16)
    with inductor_config.patch(force_disable_caches=True):
        metrics.reset()
        compiled(x.requires_grad_()).float().sum().backward()
        count = metrics.generated_kernel_count
    torch._dynamo.reset()
    return count


def _openable(types) -> type | None:
    """The float8 tensor subclass among `types` whose dispatch `deep` counting opens."""
    for t in types:
        if t.__module__.startswith(("fsdp_float8", "torchao")):
            return t
    return None


class OpCounter(TorchDispatchMode):
    """Non-view aten ops by name: `top` as dispatch sees them, `deep` inside the float8
    subclasses too (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.top: collections.Counter[str] = collections.Counter()
        self.deep: collections.Counter[str] = collections.Counter()
        self._depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sub = _openable(types)
        inner = _OPENED_OPS.get(func)
        if sub is None and inner is None:
            out = func(*args, **kwargs)
        else:
            self._depth += 1
            try:
                with self:
                    if inner is not None:
                        out = inner(*args, **kwargs)
                    else:
                        out = sub.__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._depth -= 1
        if func.namespace in _COUNTED and not _is_view(func, args, out):
            name = func.overloadpacket.__name__
            if self._depth == 0:
                self.top[name] += 1
            if sub is None and inner is None:
                self.deep[name] += 1
        return out


# ops counted: aten's, and this library's CPU GEMM (a custom op), which `deep` opens like
# a subclass: its body runs under the counter (collectives are the same in every column)
_COUNTED = ("aten", "fsdp_float8")
_OPENED_OPS = {torch.ops.fsdp_float8.cpu_scaled_mm.default: _cpu_scaled_mm}


def _is_view(func, args, out) -> bool:
    """A view does no work: view ops by schema (unless they copied), and `_unsafe_view`
    (a view whose schema declares no alias, so autograd does not track it as one)."""
    if func is torch.ops.aten._unsafe_view.default:
        return True
    return func.is_view and not _copied(args, out)


def _copied(args, out) -> bool:
    """True when an op whose schema may alias (`contiguous`, `reshape`) made a copy: its
    output does not share the input's storage."""
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    try:
        return out.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass has no storage
        return False


def _float8_filter(module: nn.Module, fqn: str) -> bool:
    return fqn != "output" and module.in_features % 16 == 0 and module.out_features % 16 == 0


def _build(lib: str, recipe: str, mesh):
    """The FSDP2 model of `f8train.bench_fsdp` (same init, bf16 params, fp32 reduce),
    converted by `lib`; returns (model, optimizer, after-step pass or None)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from f8train.model import Transformer, model_args

    margs = model_args(
        "tiny", multiple_of=16, max_seq_len=MODEL["seq"],
        **{k: MODEL[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads")},
    )  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(margs)
    model.init_weights(0)
    after_step = None
    if recipe != "bf16":
        # tensorwise: float8 all-gather (both libraries); others with "+ag" (this library's
        # rowwise float8 all-gather, which torchao does not have)
        recipe, _, flag = recipe.partition("+")
        ag = recipe == "tensorwise" or flag == "ag"
        convert(model, lib, recipe, fp8_all_gather=ag, module_filter_fn=_float8_filter)
        if lib == "torchao" and ag:
            import torchao.float8 as ao

            after_step = ao.precompute_float8_dynamic_scale_for_fsdp
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return model, opt, after_step


def _step(model, opt, after_step, step: int, rank: int) -> float:
    g = torch.Generator().manual_seed(1000 + 97 * step + rank)
    tokens = torch.randint(0, 256, (MODEL["batch"], MODEL["seq"] + 1), generator=g)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if after_step is not None:
        after_step(model)
    return loss.item()


def eager_step_ops(rank: int, world: int, lib: str, recipe: str) -> dict:
    """On one rank of an initialized gloo group: two warm-up steps, then one counted."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model, opt, after_step = _build(lib, recipe, mesh)
    if after_step is not None:
        after_step(model)
    losses = [_step(model, opt, after_step, s, rank) for s in range(2)]
    with OpCounter() as counter:
        losses.append(_step(model, opt, after_step, 2, rank))
    return {"top": dict(counter.top), "deep": dict(counter.deep), "losses": losses}


def _eager_worker(rank: int, world: int, store_path: str, cases: list, out_dir: str) -> None:
    import pickle

    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    results = {}
    for lib, recipe in cases:
        try:
            results[(lib, recipe)] = eager_step_ops(rank, world, lib, recipe)
        except Exception as exc:  # reported in the table; the next case still runs
            results[(lib, recipe)] = {"error": short_error(exc)}
        dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)


def eager_counts(cases: list[tuple[str, str]], world: int = WORLD) -> dict:
    """Spawn `world` CPU ranks, run every (lib, recipe) case, return rank 0's results
    (the ranks run the same ops; `ranks_agree` says whether their counts were equal)."""
    import pickle

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_eager_worker, args=(r, world, store, cases, tmp))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"eager count ranks exited with {[p.exitcode for p in procs]}")
        per_rank = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
                per_rank.append(pickle.load(f))
    out = per_rank[0]
    for key, result in out.items():
        result["ranks_agree"] = all(
            other[key].get("top") == result.get("top") for other in per_rank[1:]
        )
    return out


def _cases(recipes: list[str], ao_error: str | None) -> list[tuple[str, str]]:
    """(lib, recipe) rows; a recipe with "+ag" (eager only) gathers its weights in float8."""
    cases = [("bf16", "bf16")]
    for recipe in recipes:
        cases.append(("ours", recipe))
        if recipe in TORCHAO_RECIPES and ao_error is None:
            cases.append(("torchao", recipe))
        if recipe.startswith("rowwise"):
            cases.append(("ours", recipe + "+ag"))
    return cases


def _label(lib: str, recipe: str) -> str:
    if lib == "bf16":
        return "bf16"
    name = "fsdp_float8" if lib == "ours" else "torchao"
    recipe, _, flag = recipe.partition("+")
    ag = " (float8 all-gather)" if recipe == "tensorwise" or flag else ""
    return f"{name} {recipe}{ag}"


def compiled_table(cases: list[tuple[str, str]], run: Callable = compiled_kernel_count) -> dict:
    results = {}
    for lib, recipe in [c for c in cases if "+" not in c[1]]:  # "+ag" rows: eager only
        try:
            results[_label(lib, recipe)] = run("ours" if lib == "bf16" else lib, recipe)
        except Exception as exc:
            results[_label(lib, recipe)] = short_error(exc)
        print(f"compiled {_label(lib, recipe)}: {results[_label(lib, recipe)]}", flush=True)
    return results


def eager_table(cases: list[tuple[str, str]]) -> dict:
    keys = [("ours" if lib == "bf16" else lib, recipe) for lib, recipe in cases]
    raw = eager_counts(keys)
    results = {}
    for (lib, recipe), key in zip(cases, keys, strict=True):
        r = raw[key]
        if "error" in r:
            results[_label(lib, recipe)] = r
            continue
        results[_label(lib, recipe)] = {
            "top": sum(r["top"].values()),
            "deep": sum(r["deep"].values()),
            "clone": r["top"].get("clone", 0),
            "by_op_top": r["top"],
            "by_op_deep": r["deep"],
            "final_loss": r["losses"][-1],
            "ranks_agree": r["ranks_agree"],
        }
    return results


def markdown(compiled: dict, eager: dict) -> str:
    labels = list(dict.fromkeys([*compiled, *eager]))
    rows = []
    for label in labels:
        e = eager.get(label, {})
        rows.append([
            label,
            compiled.get(label, "-"),
            e.get("top", e.get("error", "-")),
            e.get("deep", "-"),
            e.get("clone", "-"),
        ])  # fmt: skip
    headers = ["", "compiled kernels", "eager ops (top)", "eager ops (deep)", "eager clones"]
    return markdown_table(headers, rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipes")
    p.add_argument("--compiled", action="store_true", help="only the compiled count")
    p.add_argument("--eager", action="store_true", help="only the eager count")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    args.recipes = [r for r in args.recipes.split(",") if r]
    unknown = sorted(set(args.recipes) - set(RECIPES))
    if unknown:
        p.error(f"unknown recipe(s) {unknown}; expected some of {list(RECIPES)}")
    if not args.compiled and not args.eager:
        args.compiled = args.eager = True
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    ao_error = torchao_error()
    cases = _cases(args.recipes, ao_error)
    compiled = compiled_table(cases) if args.compiled else {}
    eager = eager_table(cases) if args.eager else {}
    date = datetime.date.today().isoformat()
    print(f"\n{date}, torch {torch.__version__}, CPU; torchao: {ao_error or _ao_version()}\n")
    print(markdown(compiled, eager))
    payload = {"date": date, "torch": torch.__version__, "torchao_error": ao_error,
               "compiled": compiled, "eager": eager}  # fmt: skip
    write_json(args.json, payload)
    return payload


def _ao_version() -> str:
    import torchao

    return torchao.__version__


if __name__ == "__main__":
    main(sys.argv[1:])
