"""FSDP2 + float8 on a small Llama-style model: per-step time, collectives and memory.

Run (from the repository root):
    torchrun --standalone --nproc_per_node 2 -m f8train.bench_fsdp                # CPU, gloo
    torchrun --standalone --nproc_per_node 2 -m f8train.bench_fsdp --quick --json /tmp/f.json
    torchrun --standalone --nproc_per_node 1 -m f8train.bench_fsdp --device cuda --json out/fsdp.json

Every config (`CONFIGS`) trains the same model on the same batches (`fully_shard` per block
then the root, bf16 parameters, fp32 reduction) and differs only in its float8 setup. Counts
come from one probed step after the timed ones; docs/results.md explains the columns. Each
config has its own process group: one that fails is a row with its error, the next one runs.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import math
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from f8train.bench_common import (
    Report,
    bench_parser,
    fmt,
    parse_choices,
    resolve_device,
    short_error,
    step_probe,
    synchronize,
    torchao_error,
)
from f8train.float8_flags import float8_filter
from f8train.model import Transformer, model_args
from f8train.op_counter import OpCounter
from f8train.rank_exit import enable_crash_traces, exit_rank
from fsdp_float8 import CastConfig, Float8LinearConfig, convert_to_float8_training, float8_step
from fsdp_float8.tools.comm_stats import CollectiveCounter

AG = {"enable_fsdp_float8_all_gather": True}
OPERANDS = ("input", "weight", "grad_output")
DELAYED = {f"cast_config_{op}": CastConfig(scaling_type="delayed") for op in OPERANDS}
# name -> (library, tensorwise config changes, the float8 step on); None: no float8
CONFIGS: dict[str, tuple[str, dict, bool] | None] = {
    "bf16": None,
    "float8_bf16_ag": ("ours", {}, True),  # float8 GEMMs, bf16 all-gather
    "float8_ag": ("ours", AG, False),  # each weight all-reduces its scale at its all-gather
    "float8_ag_precompute": ("ours", AG, True),  # one scale collective per step
    "float8_ag_precompute_fp8_saved": ("ours", AG | {"save_input_in_float8": True}, True),
    "float8_ag_precompute_emulate": ("ours", AG | {"emulate": True}, True),  # torchao's CPU work
    "delayed": ("ours", AG | DELAYED, True),
    "torchao_float8_ag_precompute": ("torchao", AG, True),  # emulated on the CPU
}
PRESETS = {  # model and batch per preset
    "quick": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, seq=32, batch=2),
    "cpu": dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, seq=128, batch=4),
    "cuda": dict(dim=2048, n_layers=8, n_heads=16, n_kv_heads=4, seq=2048, batch=4),
}
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
FLOAT8_FILTER = float8_filter([])  # the trainer's: block linears with dims divisible by 16
_INITIAL_MODEL: dict = {}


def convert(model, lib: str, recipe: str, module_filter_fn=FLOAT8_FILTER, **changes):
    """Convert in place with `lib` ("ours" or "torchao"), a named recipe and config changes;
    returns torchao's precompute pass when it gathers in float8 (it needs one), else None."""
    if lib == "ours":
        config = Float8LinearConfig.from_recipe_name(recipe, **changes)
        convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)
        return None
    import torchao.float8 as ao

    config = dataclasses.replace(ao.Float8LinearConfig.from_recipe_name(recipe), **changes)
    ao.convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)
    gathers = config.enable_fsdp_float8_all_gather
    return ao.precompute_float8_dynamic_scale_for_fsdp if gathers else None


@dataclasses.dataclass
class Run:
    """A config's sharded model, optimizer and its after-step pass (torchao's precompute)."""

    model: nn.Module
    opt: torch.optim.Optimizer
    after_step: Callable | None
    plan: dict


def build(preset: dict, mesh: DeviceMesh, device, lib=None, recipe="tensorwise", **changes) -> Run:
    """The model of `preset` with `init_weights(0)`'s values, converted by `lib` (None:
    bf16), every block and then the root `fully_shard`ed (bf16 parameters, fp32 reduce)."""
    shape = {k: preset[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads")}
    margs = model_args("tiny", **shape, multiple_of=16, max_seq_len=preset["seq"])
    if margs not in _INITIAL_MODEL:  # drawn once per process, on the CPU
        _INITIAL_MODEL[margs] = Transformer(margs)
        _INITIAL_MODEL[margs].init_weights(0)
    model = copy.deepcopy(_INITIAL_MODEL[margs]).to(device)
    after_step = convert(model, lib, recipe, **changes) if lib else None
    plan = all_gather_plan(model, mesh.size())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return Run(model, opt, after_step, plan)


def all_gather_plan(model: nn.Module, world: int) -> dict:
    """All-gather elements of the converted weights per step and bytes of the rest, from the
    shapes: FSDP2 shards dim 0 padded to ceil(rows / world); a block is gathered twice a
    step (forward, and backward after resharding), the root once."""
    linears = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    converted = {f"{fqn}.weight" for fqn, m in linears if FLOAT8_FILTER(m, fqn)}
    conv_elems = rest_bytes = 0
    for name, p in model.named_parameters():
        elems = (2 if name.startswith("blocks.") else 1) * math.ceil(p.shape[0] / world)
        elems *= math.prod(p.shape[1:])
        conv_elems += elems if name in converted else 0
        rest_bytes += 0 if name in converted else 2 * elems  # bf16 parameters
    return {"converted_elems": conv_elems, "other_bytes": rest_bytes}


def train_step(run: Run, preset: dict, step: int, rank: int, device) -> torch.Tensor:
    """One step on this rank's batch of `step` (the same in every config); the loss."""
    g = torch.Generator().manual_seed(1000 + 97 * step + rank)
    shape = (preset["batch"], preset["seq"] + 1)
    tokens = torch.randint(0, 256, shape, generator=g).to(device)
    logits = run.model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    if run.after_step is not None:
        run.after_step(run.model)
    return loss.detach()


def _counts(counter: CollectiveCounter, probe: dict) -> dict:
    out = {f"{k}_count": counter.count(k) for k in KINDS}
    out |= {f"{k}_bytes": counter.bytes(k) for k in KINDS}
    out |= {"summary": counter.summary(), "backend_counts": probe["backend_counts"]}
    # the scale all-reduces as the backend ran them; gloo runs a reduce-scatter as an
    # all-reduce (it has no reduce-scatter events), so those are taken out
    scale = probe["backend_counts"]["all_reduce"]
    if "reduce_scatter" not in probe["backend_counts"]:
        scale -= out["reduce_scatter_count"]
    return out | {"scale_all_reduces": scale}


def measure(run: Run, args, rank: int, device) -> dict:
    """Init pass, first step, warmup, timed steps, one probed step; this rank's figures."""
    with step_probe(device) as init_probe, CollectiveCounter() as init:
        if run.after_step is not None:  # torchao's precompute before the first forward
            run.after_step(run.model)
    with step_probe(device) as first_probe, CollectiveCounter() as first:
        losses = [train_step(run, args.preset, 0, rank, device).item()]
    times = []
    for step in range(1, 1 + args.warmup + args.steps):
        dist.barrier()  # start together: the time is the step's, not a straggler's
        synchronize(device)
        t0 = time.perf_counter()
        loss = train_step(run, args.preset, step, rank, device)
        synchronize(device)
        if step > args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())
    with step_probe(device) as probe, CollectiveCounter() as steady, OpCounter() as ops:
        loss = train_step(run, args.preset, 1 + args.warmup + args.steps, rank, device)
    return {
        "step_ms": times,
        "step_ms_median": statistics.median(times),
        "init": _counts(init, init_probe),
        "first_step": _counts(first, first_probe),
        "per_step": _counts(steady, probe),
        "host_reads_per_step": ops.top["_local_scalar_dense"],
        "peak_mem_mib": probe["peak_mib"],
        "losses": [*losses, loss.item()],
    }


def run_config(name: str, args, rank: int, device) -> dict:
    group = dist.new_group(  # a failure poisons only this config's group
        backend="nccl" if device.type == "cuda" else "gloo",
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        lib, changes, step_on = CONFIGS[name] or (None, {}, True)
        if lib == "torchao":
            changes = changes | {"emulate": device.type == "cpu"}
        run = build(args.preset, DeviceMesh.from_group(group, device.type), device, lib, **changes)
        if not step_on:  # the per-weight fallback, for comparison
            float8_step(run.model).disable()
        result = {"config": name, "error": None, **measure(run, args, rank, device), **run.plan}
    except Exception as exc:  # reported in the table; the next config still runs
        result = {"config": name, "error": short_error(exc)}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def combine(per_rank: list[dict], tokens_per_step: int) -> dict:
    """Rank 0's counts; the slowest rank's time; the largest rank's memory; any error."""
    errors = [f"rank {i}: {r['error']}" for i, r in enumerate(per_rank) if r["error"]]
    if errors:
        return {"config": per_rank[0]["config"], "error": errors[0], "errors": errors}
    out = dict(per_rank[0])
    out["step_ms_median"] = max(r["step_ms_median"] for r in per_rank)
    out["tokens_per_s"] = tokens_per_step / (out["step_ms_median"] * 1e-3)
    mems = [r["peak_mem_mib"] for r in per_rank if r["peak_mem_mib"] is not None]
    out["peak_mem_mib"] = max(mems) if mems else None
    ag_bytes = out["per_step"]["all_gather_bytes"]
    if ag_bytes and out["converted_elems"]:  # (FSDP2 may skip all-gathers on one rank)
        out["converted_ag_bytes"] = ag_bytes - out["other_bytes"]
        per_elem = out["converted_ag_bytes"] / out["converted_elems"]
        out["converted_ag_bytes_per_elem"] = per_elem
        out["converted_ag_ratio_vs_bf16_bytes"] = per_elem / 2
    out["final_loss"] = statistics.fmean(r["losses"][-1] for r in per_rank)
    return out


HEADERS = ["config", "step ms", "AG MiB/step", "conv AG ratio", "RS MiB/step"]
HEADERS += ["AG/RS/AR per step", "scale ARs: init/first/step", "peak MiB", "host reads"]
HEADERS += ["final loss", "error"]


def cells(r: dict) -> list[str]:
    if "per_step" not in r:  # a failed config: its error only
        return [r["config"], *["-"] * (len(HEADERS) - 2), r["error"]]
    s, phases = r["per_step"], ("init", "first_step", "per_step")
    line = [r["config"], fmt(r["step_ms_median"], ".1f"), fmt(s["all_gather_bytes"] / 2**20, ".3f")]
    line += [fmt(r.get("converted_ag_ratio_vs_bf16_bytes"), ".3f")]
    line += [fmt(s["reduce_scatter_bytes"] / 2**20, ".3f")]
    line += ["/".join(str(s[f"{k}_count"]) for k in KINDS)]
    line += ["/".join(str(r[p]["scale_all_reduces"]) for p in phases)]
    line += [fmt(r["peak_mem_mib"], ".1f"), str(r["host_reads_per_step"])]
    return line + [fmt(r["final_loss"], ".4f"), r["error"] or ""]


COLUMNS = [(h, lambda r, i=i: cells(r)[i]) for i, h in enumerate(HEADERS)]


def main(argv: list[str] | None = None) -> dict | None:
    p = bench_parser(__doc__, timing=False)
    p.set_defaults(device="cpu")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated configs")
    args = p.parse_args(argv)
    args.configs = parse_choices(p, args.configs, CONFIGS, "config(s)")
    args.preset = PRESETS["quick" if args.quick else args.device.split(":")[0]]
    args.warmup, args.steps = (1, 2) if args.quick else (2, 5)  # untimed, timed steps
    device = resolve_device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ao_error = torchao_error() if "torchao_float8_ag_precompute" in args.configs else None
    emulate = device.type == "cpu"
    report = Report("fsdp", device, args, COLUMNS, torchao_error=ao_error, torchao_emulate=emulate)
    report.payload["environment"]["world_size"] = world
    for name in args.configs:
        if name.startswith("torchao") and ao_error:
            result = {"config": name, "error": f"skipped, torchao unavailable: {ao_error}"}
        else:
            gathered: list = [None] * world
            dist.all_gather_object(gathered, run_config(name, args, rank, device))
            result = combine(gathered, args.preset["batch"] * args.preset["seq"] * world)
        if rank == 0:
            report.add(result)
    payload = report.done() if rank == 0 else None
    dist.destroy_process_group()
    return payload


if __name__ == "__main__":  # process-wide: crash traces on, no finalization at exit
    enable_crash_traces()
    main()
    exit_rank(0)
