"""Float8 pretraining of the Llama-style workload model under FSDP2.

    torchrun --standalone --nproc_per_node 2 -m f8train.train        # = make train (CPU, tiny)
    torchrun --standalone --nproc_per_node 2 -m f8train.train --recipe off   # bf16 baseline
    torchrun --standalone --nproc_per_node 8 -m f8train.train --device cuda --preset small

One step: this rank's rows of the global batch -> forward/backward (FSDP2 all-gathers each
block's weights, in float8 for converted linears with ``--fp8-all-gather``) -> clip gradients
-> one all-reduce of the loss and the stop flag, so all ranks agree whether to go on ->
optimizer and LR step. A run whose ``--out`` holds a checkpoint resumes from it
(``f8train/resume.py``). Stops, failures and outputs: docs/trainer.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from f8train import checkpoint as ck
from f8train import process_group as pg
from f8train import train_log as log
from f8train.data import TokenData, check_token_ids, load_tokens
from f8train.float8_flags import block_all_gather_problem, describe, float8_config
from f8train.model import build_args, flops_per_token, num_params
from f8train.moe import moe_aux_loss, moe_fields
from f8train.rank_exit import argument_time, enable_crash_traces, exit_rank
from f8train.resume import checkpoint_settings, find_resume
from f8train.run_control import GracefulStop, acquire_lock, fault_hooks, release_lock
from f8train.sharded_model import build_model, build_optimizer, build_scheduler, conversion_counts
from f8train.token_batches import TokenBatcher, ValidationBatches
from f8train.token_cache import CACHE_ENV
from f8train.train_args import batch_split_problem, parse_args
from fsdp_float8 import Float8LinearConfig, Float8Telemetry, NVFP4Config, float8_step
from fsdp_float8 import sync_float8_amax_and_scale_history as sync_float8
from fsdp_float8.tools.comm_stats import CollectiveCounter
from fsdp_float8.tools.telemetry import append_jsonl

EXIT_NON_FINITE = 3


class Trainer:
    """Holds the run's objects; ``run()`` trains from the resumed step to ``--steps``."""

    def __init__(
        self, args: argparse.Namespace, config: Float8LinearConfig | NVFP4Config | None, d: pg.Dist
    ):
        self.args, self.config, self.d, self.out = args, config, d, Path(args.out)
        torch.manual_seed(args.seed)
        self.data = load_data(args)
        if (why := same_data_problem(self.data)) is not None:
            raise SystemExit(why)
        # the ranks of a tensor-parallel group read the same batch: split over dp only
        layout = dict(seq_len=args.seq_len, global_batch=args.global_batch)
        layout |= dict(rank=d.rank // d.tp, world_size=d.world_size // d.tp)
        self.batcher = TokenBatcher(
            self.data.train, **layout, seed=args.seed, batch_change=args.allow_batch_change
        )
        self.val = ValidationBatches(self.data.val, **layout, num_batches=args.val_batches)
        self.ckpt = ck.Checkpointer(
            self.out / "checkpoints", keep=args.keep_ckpts, is_main=d.is_main
        )
        self.settings = checkpoint_settings(args)
        # verified and compared before the model is built: a refusal costs no build
        self.resume_point = find_resume(args, self.ckpt, self.settings)
        self.ckpt.check_space(None)  # room for a checkpoint like the last one, or stop now
        self.model, self.report = build_model(args, d, config)
        self.optimizer = build_optimizer(self.model, args)
        self.scheduler = build_scheduler(self.optimizer, args)
        self.progress_state = ck.ProgressState()
        self.state = {  # what a checkpoint holds
            "app": ck.ModelOptimizerState(self.model, self.optimizer),
            "scheduler": ck.SchedulerState(self.scheduler),
            "batcher": self.batcher,
            "rng": ck.RNGState(),
            "progress": self.progress_state,
        }
        if config is not None and not args.precompute and args.scaling == "dynamic":
            float8_step(self.model).disable()  # measure the per-weight fallback
        self.tokens_per_step = args.global_batch * args.seq_len
        self.flops_per_token = flops_per_token(self.model.args, args.seq_len)
        self.peak_flops = log.peak_flops(d.device, args.peak_tflops)
        self.progress = log.Progress(args.steps, enabled=d.is_main, log_every=args.log_every)
        self.say = self.progress.message
        self.telemetry = None

    def resume(self) -> int:
        """Load the checkpoint to resume from, if any; returns the step it was saved at."""
        point = self.resume_point
        if point is None:
            return 0
        self.ckpt.load(point.path, self.state)
        if self.config is not None:  # as at the save: the step metrics match a run that
            sync_float8(self.model)  # did not stop (no first check)
        step = self.progress_state.step
        self.say(f"resumed from {point.path} at step {step} (world size {self.d.world_size})")
        for change in point.changed:
            self.say(f"  changed on resume: {change}")
        return step

    def header(self, start_step: int) -> None:
        """Write ``run.json`` and print what this run trains."""
        a, d, report, point = self.args, self.d, self.report, self.resume_point
        info = {
            "args": vars(a),
            "world_size": d.world_size,
            "mesh": d.mesh_shape(),
            "params": num_params(self.model, exclude_embedding=False),
            **conversion_counts(self.model, report),
            "data": self.data.source,
        }
        if point is not None:
            info["resumed_from"] = str(point.path)
            info["settings_changed_on_resume"] = point.changed
            info["damaged_checkpoints_set_aside"] = [str(p) for p in point.damaged]
        if d.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "run.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
        self.say(
            f"{d.world_size} rank(s) on {d.device.type}, mesh {info['mesh']}; model "
            f"{a.preset} {info['params']:,} params ({info['float8_params']:,} in float8 "
            f"linears); {self.tokens_per_step:,} tokens/step; data {self.data.source}\n"
            f"config: {describe(a)}\n"
            f"{report or 'float8: off (high-precision baseline)'}\n"
            f"out: {self.out}  (from step {start_step} to {a.steps})"
        )
        if self.data.cache is not None:  # a file outside the repository: say where it is
            size = self.data.cache.stat().st_size / 2**20
            self.say(
                f"token cache: {self.data.cache} ({size:.0f} MiB; move it with --cache-dir "
                f"or {CACHE_ENV})"
            )

    def loss_of(self, inputs: torch.Tensor, targets: torch.Tensor, reduction="mean"):
        logits = self.model(inputs.to(self.d.device)).float().flatten(0, 1)
        return F.cross_entropy(logits, targets.to(self.d.device).flatten(), reduction=reduction)

    def train_step(self, step: int, stop: GracefulStop) -> tuple[dict, bool]:
        """One optimizer step; returns its metrics record and whether to stop after it."""
        a = self.args
        counter = CollectiveCounter() if a.comm_every > 0 and step % a.comm_every == 0 else None
        inputs, targets = next(self.batcher)
        start = time.perf_counter()
        with counter or nullcontext():
            loss = self.loss_of(inputs, targets)
            if (aux := moe_aux_loss(self.model)) is not None:  # MoE: the load-balancing loss
                loss = loss + aux
            if step == a.nan_at_step:  # test hook
                loss = loss * float("nan")
            loss.backward()
            max_norm = a.grad_clip if a.grad_clip > 0 else float("inf")
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
            grad_norm = (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()
            # one all-reduce (SUM: gloo has no AVG): the mean loss, and whether any rank
            # was asked to stop
            flag = loss.new_tensor(1.0 if stop.requested else 0.0, dtype=torch.float32)
            both = torch.stack([loss.detach().float(), flag])
            dist.all_reduce(both)
            loss_value, stop_requested = both[0].item() / self.d.world_size, both[1].item() > 0
            if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
                raise _NonFinite(f"loss {loss_value}, grad norm {grad_norm}")
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.d.device.type == "cuda":
            torch.cuda.synchronize(self.d.device)
        seconds = time.perf_counter() - start
        tokens_per_s = self.tokens_per_step / seconds
        peak = self.peak_flops * self.d.world_size if self.peak_flops else None
        record = {
            "step": step,
            "loss": loss_value,
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s,
            "step_time_s": seconds,
            **log.comm_fields(counter),
            "peak_memory_bytes": log.peak_memory_bytes(self.d.device),
            "mfu": self.flops_per_token * tokens_per_s / peak if peak else None,
            **moe_fields(self.model),
        }
        return record, stop_requested

    @torch.no_grad()
    def validate(self) -> float:
        """Mean token loss over the fixed validation batches (all ranks together)."""
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.d.device)
        for inputs, targets in self.val:
            total[0] += self.loss_of(inputs, targets, reduction="sum")
            total[1] += targets.numel()
        dist.all_reduce(total)
        self.model.train()
        return (total[0] / total[1]).item()

    def save(self, step: int) -> None:
        start = time.perf_counter()
        if self.config is not None:  # the refresh is lazy: save reduced delayed amaxes
            sync_float8(self.model)
        path = self.ckpt.save(step, self.state, self.settings)
        self.say(f"step {step}: saved checkpoint {path} ({time.perf_counter() - start:.1f} s)")

    def run(self) -> int:
        start = self.resume()
        self.header(start)
        metrics = log.MetricsFile(
            self.out / "metrics.jsonl", enabled=self.d.is_main, resume_step=start
        )
        if metrics.dropped:
            self.say(
                f"note: {metrics.dropped} line(s) of {metrics.path} after step {start} moved "
                f"to {metrics.dropped_path} (this run trains those steps again)"
            )
        if start >= self.args.steps:
            self.say(f"nothing to do: the run in {self.out} is at step {start}/{self.args.steps}")
            return self.finish()
        if self.config is not None and self.args.numerics_every > 0:
            every = self.args.numerics_every
            self.telemetry = Float8Telemetry(self.model, every=every, start_step=start + 1)
        with GracefulStop() as stop:
            return self.loop(start, metrics, stop)

    def loop(self, start: int, metrics: log.MetricsFile, stop: GracefulStop) -> int:
        a = self.args
        for step in range(start + 1, a.steps + 1):
            try:
                record, stop_requested = self.train_step(step, stop)
            except _NonFinite as err:
                self.say(
                    f"error: non-finite training values at step {step} ({err}); stopped before "
                    f"the optimizer step. Newest checkpoint: {self.ckpt.latest() or 'none'} (its "
                    "files are checked against their checksums when the run resumes). Lower "
                    "--lr, set --grad-clip, or use --recipe off to check whether float8 is the "
                    "cause."
                )
                return EXIT_NON_FINITE
            self.progress_state.step = step
            self.progress_state.tokens += self.tokens_per_step
            last = step == a.steps
            if a.val_every > 0 and (step % a.val_every == 0 or last):
                record["val_loss"] = self.validate()
                self.say(f"step {step}: val loss {record['val_loss']:.4f}")
            metrics.write(record)
            if self.telemetry is not None:  # every rank flushes: its warnings name its layers
                self.telemetry.step()
                records = self.telemetry.flush()
                if self.d.is_main and records:
                    append_jsonl(self.out / "numerics.jsonl", records)
            self.progress.step(record)
            early = stop_requested or step == a.stop_at_step
            if last or early or (a.ckpt_every > 0 and step % a.ckpt_every == 0):
                self.save(step)
            fault_hooks(step, a, self.d.rank, self.d.world_size)
            if early:
                why = f"signal {stop.signal_name}" if stop_requested else "--stop-at-step"
                self.say(f"stopped after step {step} ({why}); rerun to resume")
                return 0
        return self.finish()

    def finish(self) -> int:
        if self.d.is_main:
            path = self.out / "summary.json"
            records = log.read_metrics(self.out / "metrics.jsonl")
            s = log.summary(records, {"config": describe(self.args)})
            path.write_text(json.dumps(s, indent=2) + "\n")
            self.say(f"summary ({path}):\n{log.format_summary(s)}")
        return 0


class _NonFinite(Exception):
    pass


def load_data(args: argparse.Namespace) -> TokenData:
    """The corpus, with every token id checked against the model's vocabulary."""
    try:
        data = load_tokens(
            args.data,
            cache_dir=args.cache_dir,
            token_dtype=args.token_dtype,
            val_fraction=args.val_fraction,
        )
        check_token_ids(data, build_args(args).vocab_size)
    except (OSError, ValueError) as err:
        raise SystemExit(f"--data: {err}") from None
    return data


def same_data_problem(data: TokenData) -> str | None:
    """Every rank must read the same tokens (the batches are drawn from one shared corpus):
    their count and a hash of the first and last 2**19 tokens are compared (collective)."""
    tokens = np.asarray(data.tokens)
    edges = hashlib.sha256(tokens[: 1 << 19].tobytes() + tokens[-(1 << 19) :].tobytes())
    mine = {"tokens": len(tokens), "sha256 of the first and last 2**19": edges.hexdigest()[:16]}
    lines = pg.differences(pg.all_gather_object(mine), show=str)
    if not lines:
        return None
    listed = "\n".join(f"  {line}" for line in lines)
    return (
        f"--data: the ranks read different data ({data.source} on this rank):\n{listed}\n"
        "every rank must read the same corpus: give each node the same --data (a copy "
        "with the same files, or a shared folder)"
    )


def main(argv: list[str] | None = None) -> int:
    with argument_time():  # under torchrun, rank 0 alone prints a refusal
        args, config = check_arguments(argv)
    try:
        d = pg.init_distributed(args)
    except RuntimeError as err:
        if (message := pg.start_failure_message(err, args.pg_timeout_s)) is None:
            raise
        raise SystemExit(message) from None
    try:
        why = pg.broadcast_from_0(acquire_lock(Path(args.out)) if d.is_main else None)
        if why is not None:  # every rank stops, naming the job that holds --out
            raise SystemExit(why)
        if (why := pg.out_shared_problem(Path(args.out))) is not None:
            raise SystemExit(why)
        return Trainer(args, config, d).run()
    except RuntimeError as err:
        message = pg.collective_failure_message(err, d.rank, args.pg_timeout_s)
        if message is None:
            raise
        raise SystemExit(message) from None
    finally:
        if d.is_main:  # only the lock this process holds
            release_lock(Path(args.out))
        dist.destroy_process_group()


def check_arguments(
    argv: list[str] | None,
) -> tuple[argparse.Namespace, Float8LinearConfig | NVFP4Config | None]:
    """The flags and the float8 config, or a refusal (``SystemExit``) before anything starts;
    every rank decides alike."""
    args = parse_args(argv)
    config = float8_config(args)  # refuse bad flag combinations before starting anything
    world = int(os.environ.get("WORLD_SIZE", "1"))
    shards = max(1, world // (args.hsdp_replicate * args.tp))  # what fully_shard shards over
    resuming = bool(
        ck.Checkpointer(Path(args.out) / "checkpoints", keep=1, is_main=False).complete()
    )
    problem = block_all_gather_problem(args, config, shards, resuming=resuming)
    problem = problem or batch_split_problem(
        args.global_batch, max(1, world // args.tp), resuming=resuming
    )
    if problem is not None:  # every rank decides alike, before any process group
        raise SystemExit(problem)
    return args, config


if __name__ == "__main__":  # process-wide: crash traces on, no finalization at exit
    enable_crash_traces()
    exit_rank(main())
