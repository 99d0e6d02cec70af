"""FSDP2 + float8 on a small Llama-style model: per-step time, collectives and memory.

Run (from the repository root):
    torchrun --standalone --nproc_per_node 2 -m f8train.bench_fsdp                # CPU, gloo
    torchrun --standalone --nproc_per_node 2 -m f8train.bench_fsdp --quick --json /tmp/f.json
    torchrun --standalone --nproc_per_node 1 -m f8train.bench_fsdp --device cuda --json out/fsdp.json

Every config trains the same model (same seed and per-rank batches, `fully_shard` per block
then the root, bf16 parameters, fp32 gradient reduction) and differs only in its float8
setup: `bf16`; `float8_bf16_ag` (tensorwise GEMMs, bf16 all-gather); `float8_ag` (float8
all-gather, the float8 step off: each weight's scale all-reduced in its pre-all-gather);
`float8_ag_precompute` (the float8 step on: one scale collective per step, the loop calls no
float8 function), also with inputs saved in float8 (`_fp8_saved`) and emulated (`_emulate`);
`delayed` (delayed scaling, float8 all-gather); `torchao_float8_ag_precompute` (torchao's
float8 all-gather and precompute, when torchao imports; emulated on the CPU, so compare its
bytes and collectives there, not its time).

Table columns: the slowest rank's median step; all-gather and reduce-scatter MiB per step;
`conv AG ratio`, the converted weights' all-gather bytes over their bf16 bytes (the other
parameters' bytes, known from their shapes, are subtracted: bf16 reads 1.000); collectives
per step by kind (`CollectiveCounter`); the scale all-reduces the backend ran before the first
forward, in the first step and in a steady step (profiler events, which also see DTensor's own
collectives); the probed step's peak memory above what was live before it; host reads
(`.item()` and the like: each a sync on a GPU); the final loss. Counts come from one extra
probed step outside the timed ones. Each config runs on its own process group, so one that
fails is reported in the table and the next one still runs.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from f8train.bench_common import (
    HostReads,
    StepProbe,
    environment,
    fmt,
    markdown_table,
    parse_choices,
    resolve_device,
    short_error,
    synchronize,
    write_json,
)
from f8train.float8_flags import float8_filter
from f8train.model import Transformer, model_args
from f8train.rank_exit import enable_crash_traces, exit_rank
from fsdp_float8 import (
    CastConfig,
    Float8LinearConfig,
    convert_to_float8_training,
    float8_step,
)
from fsdp_float8.tools.comm_stats import CollectiveCounter

CONFIGS = (
    "bf16",
    "float8_bf16_ag",
    "float8_ag",
    "float8_ag_precompute",
    "float8_ag_precompute_fp8_saved",  # + linear inputs saved for backward in float8
    "float8_ag_precompute_emulate",  # the same work as torchao's emulated CPU run
    "delayed",
    "torchao_float8_ag_precompute",
)
PRESETS = {  # model and batch per preset: dim, n_layers, n_heads, n_kv_heads, seq, batch
    "quick": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, seq=32, batch=2),
    "cpu": dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, seq=128, batch=4),
    "cuda": dict(dim=2048, n_layers=8, n_heads=16, n_kv_heads=4, seq=2048, batch=4),
}


KINDS = ("all_gather", "reduce_scatter", "all_reduce")
OPERANDS = ("input", "weight", "grad_output")
FLOAT8_FILTER = float8_filter([])  # the trainer's: block linears with dims divisible by 16


@dataclass
class Run:
    """One config's model, optimizer and its float8 pass."""

    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    after_step: object  # callable(model) or None
    precompute_first: bool


def _float8_config(name: str) -> Float8LinearConfig:
    if name == "float8_bf16_ag":
        return Float8LinearConfig.from_recipe_name("tensorwise")
    if name == "delayed":
        delayed = {f"cast_config_{op}": CastConfig(scaling_type="delayed") for op in OPERANDS}
        return Float8LinearConfig(**delayed, enable_fsdp_float8_all_gather=True)
    return Float8LinearConfig.from_recipe_name(
        "tensorwise",
        enable_fsdp_float8_all_gather=True,
        save_input_in_float8=name.endswith("_fp8_saved"),
        emulate=name.endswith("_emulate"),
    )


def _convert(name: str, model: nn.Module, device: torch.device):
    """Convert in place; returns (after_step pass or None, precompute before first forward)."""
    if name == "bf16":
        return None, False
    if name.startswith("torchao"):
        import torchao.float8 as ao

        # On the CPU torchao's torch._scaled_mm call (0-d scales) takes a oneDNN path about
        # 100x slower than ours; its emulation (dequantize + matmul) keeps the same casts,
        # all-gathers and scale all-reduces at a usable speed.
        config = ao.Float8LinearConfig(
            enable_fsdp_float8_all_gather=True, emulate=device.type == "cpu"
        )
        ao.convert_to_float8_training(model, config=config, module_filter_fn=FLOAT8_FILTER)
        return ao.precompute_float8_dynamic_scale_for_fsdp, True
    convert_to_float8_training(model, config=_float8_config(name), module_filter_fn=FLOAT8_FILTER)
    if name == "float8_ag":  # the per-weight fallback, for comparison
        float8_step(model).disable()
    return None, False


def all_gather_plan(model: nn.Module, world: int) -> dict:
    """Per-step all-gather elements of the converted weights and bytes of everything else,
    from the parameter shapes: FSDP2 shards dim 0 padded to ceil(rows / world); a block is
    gathered twice a step (forward, and again for backward after resharding), the root
    once. Call before `fully_shard`."""
    converted = {
        f"{fqn}.weight"
        for fqn, m in model.named_modules()
        if isinstance(m, nn.Linear) and FLOAT8_FILTER(m, fqn)
    }
    conv_elems, rest_bytes = 0, 0
    for name, p in model.named_parameters():
        padded = math.ceil(p.shape[0] / world) * math.prod(p.shape[1:])
        gathers = 2 if name.startswith("blocks.") else 1
        if name in converted:
            conv_elems += gathers * padded
        else:
            rest_bytes += gathers * padded * 2  # bf16 parameters
    return {"converted_elems": conv_elems, "other_bytes": rest_bytes}


_INITIAL_STATE: dict = {}


def initial_state(margs) -> dict[str, torch.Tensor]:
    """Parameters and buffers of `Transformer(margs).init_weights(0)`, on the CPU, computed
    once per process: every config starts from them without paying the CPU init again."""
    if margs not in _INITIAL_STATE:
        ref = Transformer(margs)
        ref.init_weights(0)
        _INITIAL_STATE[margs] = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
    return _INITIAL_STATE[margs]


def _tensor(model: nn.Module, key: str) -> torch.Tensor:
    module_name, _, attr = key.rpartition(".")
    return getattr(model.get_submodule(module_name), attr)


def build(name: str, args, mesh: DeviceMesh, device: torch.device) -> tuple[Run, dict]:
    margs = model_args(
        "tiny",
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        multiple_of=16,
        max_seq_len=args.seq,
    )
    with torch.device("meta"):
        model = Transformer(margs)
    model.to_empty(device=device)
    with torch.no_grad():  # the same values as init_weights(0), drawn once per process
        for key, value in initial_state(margs).items():
            _tensor(model, key).copy_(value)
    after_step, precompute_first = _convert(name, model, device)
    plan = all_gather_plan(model, mesh.size())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return Run(name, model, opt, after_step, precompute_first), plan


def batch(args, step: int, rank: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 97 * step + rank)
    return torch.randint(0, 256, (args.batch, args.seq + 1), generator=g).to(device)


def train_step(run: Run, tokens: torch.Tensor) -> torch.Tensor:
    logits = run.model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    if run.after_step is not None:
        run.after_step(run.model)
    return loss.detach()


def _counts(counter: CollectiveCounter, probe: StepProbe) -> dict:
    out = {f"{k}_count": counter.count(k) for k in KINDS}
    out |= {f"{k}_bytes": counter.bytes(k) for k in KINDS}
    out["summary"] = counter.summary()
    out["backend_counts"] = probe.backend_counts
    # The scale all-reduces as the backend ran them. gloo runs each reduce-scatter as an
    # all-reduce (it has no reduce-scatter events), so those are taken out.
    scale = probe.backend_counts.get("all_reduce", 0)
    if "reduce_scatter" not in probe.backend_counts:
        scale -= out["reduce_scatter_count"]
    out["scale_all_reduces"] = scale
    return out


def measure(run: Run, args, rank: int, device: torch.device) -> dict:
    """Init pass, first step, warmup, timed steps, one probed step; this rank's figures."""
    with StepProbe(device) as init_probe, CollectiveCounter() as init:
        if run.precompute_first:
            run.after_step(run.model)
    losses, times = [], []
    with StepProbe(device) as first_probe, CollectiveCounter() as first:
        losses.append(train_step(run, batch(args, 0, rank, device)).item())
    for step in range(1, 1 + args.warmup + args.steps):
        dist.barrier()  # start together: the time is the step's, not a straggler's
        synchronize(device)
        t0 = time.perf_counter()
        loss = train_step(run, batch(args, step, rank, device))
        synchronize(device)
        if step > args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())
    step = 1 + args.warmup + args.steps
    with StepProbe(device) as probe, CollectiveCounter() as steady, HostReads() as reads:
        loss = train_step(run, batch(args, step, rank, device))
    losses.append(loss.item())
    return {
        "step_ms": times,
        "step_ms_median": statistics.median(times),
        "init": _counts(init, init_probe),
        "first_step": _counts(first, first_probe),
        "per_step": _counts(steady, probe),
        "host_reads_per_step": reads.count,
        "device_syncs_per_step": reads.device_count,
        "peak_mem_mib": probe.peak_mib,
        "losses": losses,
    }


def run_config(name: str, args, rank: int, world: int, device: torch.device) -> dict:
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=args.timeout)
    group = dist.new_group(backend=backend, timeout=timeout)  # a failure poisons only it
    mesh = DeviceMesh.from_group(group, device.type)
    try:
        run, plan = build(name, args, mesh, device)
        result = {"config": name, "error": None, **measure(run, args, rank, device), **plan}
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


def table(results: list[dict]) -> str:
    headers = ["config", "step ms", "AG MiB/step", "conv AG ratio", "RS MiB/step"]
    headers += ["AG/RS/AR per step", "scale ARs: init/first/step", "peak MiB", "host reads"]
    headers += ["final loss", "error"]
    rows = []
    for r in results:
        if "per_step" not in r:
            rows.append([r["config"]] + ["-"] * (len(headers) - 2) + [r["error"] or ""])
            continue
        s = r["per_step"]
        kinds = "/".join(str(s[f"{k}_count"]) for k in KINDS)
        scale_ars = "/".join(
            str(r[k]["scale_all_reduces"]) for k in ("init", "first_step", "per_step")
        )
        mib = [fmt(s[f"{k}_bytes"] / 2**20, ".3f") for k in ("all_gather", "reduce_scatter")]
        ratio = fmt(r.get("converted_ag_ratio_vs_bf16_bytes"), ".3f")
        rows.append([r["config"], fmt(r["step_ms_median"], ".1f"), mib[0], ratio, mib[1], kinds])
        rows[-1] += [scale_ars, fmt(r["peak_mem_mib"], ".1f"), str(r["host_reads_per_step"])]
        rows[-1] += [fmt(r["final_loss"], ".4f"), r["error"] or ""]
    return markdown_table(headers, rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated configs")
    p.add_argument("--preset", default=None, help="quick | cpu | cuda (default: per device)")
    for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "seq", "batch"):
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None, help="untimed steps after the first")
    p.add_argument("--steps", type=int, default=None, help="timed steps")
    p.add_argument("--timeout", type=float, default=120, help="seconds before a collective fails")
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke)")
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    args = p.parse_args(argv)
    args.configs = parse_choices(p, args.configs, CONFIGS, "config(s)")
    preset = args.preset or ("quick" if args.quick else args.device.split(":")[0])
    for key, value in PRESETS[preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.preset = preset
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.steps = args.steps if args.steps is not None else (2 if args.quick else 5)
    return args


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ao_error = None
    if "torchao_float8_ag_precompute" in args.configs:
        try:
            import torchao.float8  # noqa: F401
        except Exception as exc:
            ao_error = short_error(exc)
    results = []
    for name in args.configs:
        if name.startswith("torchao") and ao_error:
            results.append({"config": name, "error": f"skipped, torchao unavailable: {ao_error}"})
            continue
        mine = run_config(name, args, rank, world, device)
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        results.append(combine(gathered, args.batch * args.seq * world))
        if rank == 0:
            r = results[-1]
            print(f"{name}: step {fmt(r.get('step_ms_median'), '.1f')} ms {r['error'] or ''}")
            write_json(args.json, _payload(args, device, world, ao_error, results))
    payload = None
    if rank == 0:
        payload = _payload(args, device, world, ao_error, results)
        print()
        print(table(results))
        write_json(args.json, payload)
    dist.destroy_process_group()
    return payload


def _payload(args, device, world: int, ao_error: str | None, results: list[dict]) -> dict:
    return {
        "benchmark": "fsdp",
        "environment": environment(device) | {"world_size": world},
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "torchao_error": ao_error,
        "torchao_emulate": device.type == "cpu",
        "results": results,
    }


if __name__ == "__main__":  # process-wide: crash traces on, no finalization at exit
    enable_crash_traces()
    main()
    exit_rank(0)
