"""Run a function on N CPU ranks (gloo) from inside a pytest test.

Mental model: ``run_distributed(fn, world_size, tmp_path, ...)`` is a tiny, test-only
``torchrun``. It spawns ``world_size`` fresh Python processes (``torch.multiprocessing``,
spawn context), each joins a gloo process group rendezvoused through a ``FileStore`` under
the test's ``tmp_path`` (no ports, so parallel test runs cannot collide), runs
``fn(rank, world_size, *args, **kwargs)``, tears the group down, and writes its return
value to a file. The parent polls those files and returns the per-rank results as a list.

Failure is loud and fast:
- an exception on any rank is raised in the parent as ``DistributedError`` carrying the
  rank and the child's full traceback text (other ranks are given a short grace period,
  then killed, because they are usually stuck waiting for the failed rank);
- a rank that dies without reporting (segfault, ``os._exit``) is reported with its exit code;
- if the job outlives ``timeout_s`` (typically a collective that only some ranks called),
  the Python stacks of the stuck ranks are dumped (faulthandler), every child is killed,
  and ``DistributedTimeoutError`` says which ranks were still running and where.

``fn`` and its arguments must be picklable: define ``fn`` at module level in the test
module. Process start-up (importing torch) costs a couple of seconds per spawn, so run a
grid of cases inside one ``fn`` rather than one spawn per case.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "DistributedError",
    "DistributedTimeoutError",
    "cpu_mesh",
    "run_distributed",
]

# After the first rank fails, how long the others get to report their own errors before
# they are killed (they are usually blocked in a collective that will never complete).
_FAILURE_GRACE_S = 3.0
_POLL_S = 0.02


class DistributedError(RuntimeError):
    """A rank of a ``run_distributed`` job failed.

    ``rank`` is the first rank that failed, ``traceback_text`` its formatted traceback and
    ``exception`` the original exception object when it could be pickled back (else None).
    The message holds the tracebacks of every rank that reported an error.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None,
        traceback_text: str = "",
        exception: BaseException | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.traceback_text = traceback_text
        self.exception = exception


class DistributedTimeoutError(DistributedError, TimeoutError):
    """A ``run_distributed`` job did not finish within its ``timeout_s``."""


@dataclass
class _Report:
    rank: int
    ok: bool
    value: Any = None
    traceback_text: str = ""
    # Pickled separately: an exception that pickles may still fail to unpickle (custom
    # __init__ signatures), and that must not cost us the traceback text.
    exception_pickle: bytes | None = None
    finished_at: float = 0.0

    def exception(self) -> BaseException | None:
        if self.exception_pickle is None:
            return None
        try:
            return pickle.loads(self.exception_pickle)
        except Exception:
            return None


def cpu_mesh(shape: int | Sequence[int], names: Sequence[str] | None = None) -> DeviceMesh:
    """``init_device_mesh("cpu", shape, mesh_dim_names=names)`` over the default group."""
    shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
    names_t = tuple(names) if names is not None else None
    return init_device_mesh("cpu", shape_t, mesh_dim_names=names_t)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    tmp_path: str | os.PathLike[str],
    *args: Any,
    timeout_s: float = 120,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    Returns the list of per-rank return values, indexed by rank. Raises
    ``DistributedError`` if any rank raised or died, ``DistributedTimeoutError`` if the
    job ran longer than ``timeout_s`` seconds (all children are killed either way).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}; pass the number of ranks")
    Path(tmp_path).mkdir(parents=True, exist_ok=True)
    # A fresh directory per call: a FileStore file must not be reused by a second job.
    job_dir = Path(tempfile.mkdtemp(prefix="dist-", dir=tmp_path))
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_child_main,
            args=(rank, world_size, str(job_dir), os.getpid(), fn, args, kwargs),
            name=f"rank{rank}",
        )
        for rank in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        return _wait(procs, job_dir, fn, timeout_s)
    finally:
        _kill_all(procs)


def _wait(procs: list[Any], job_dir: Path, fn: Callable[..., Any], timeout_s: float) -> list[Any]:
    world_size = len(procs)
    start = time.monotonic()
    deadline = start + timeout_s
    reports: dict[int, _Report] = {}
    first_failure_at: float | None = None
    while True:
        for rank in range(world_size):
            if rank not in reports:
                report = _read_report(job_dir, rank)
                if report is None and procs[rank].exitcode is not None:
                    # Re-read: the file may have landed between the two checks.
                    report = _read_report(job_dir, rank) or _died_report(rank, procs[rank])
                if report is not None:
                    reports[rank] = report
        failed = [r for r in reports.values() if not r.ok]
        if failed and first_failure_at is None:
            first_failure_at = time.monotonic()
        now = time.monotonic()
        all_done = len(reports) == world_size and all(p.exitcode is not None for p in procs)
        grace_over = first_failure_at is not None and (
            now - first_failure_at > _FAILURE_GRACE_S or now > deadline
        )
        if all_done or grace_over:
            break
        if now > deadline:
            raise _timeout_error(procs, job_dir, fn, timeout_s, reports)
        time.sleep(_POLL_S)
    if failed:
        raise _failure_error(fn, failed, world_size)
    return [reports[rank].value for rank in range(world_size)]


def _failure_error(
    fn: Callable[..., Any], failed: list[_Report], world_size: int
) -> DistributedError:
    failed = sorted(failed, key=lambda r: r.finished_at)
    first = failed[0]
    ranks = ", ".join(str(r.rank) for r in failed)
    parts = [f"{_fn_name(fn)} failed on rank {first.rank} of {world_size} (failed ranks: {ranks})"]
    for r in failed:
        parts.append(f"\n----- rank {r.rank} -----\n{r.traceback_text.rstrip()}")
    exception = first.exception()
    err = DistributedError(
        "\n".join(parts),
        rank=first.rank,
        traceback_text=first.traceback_text,
        exception=exception,
    )
    err.__cause__ = exception
    return err


def _timeout_error(
    procs: list[Any],
    job_dir: Path,
    fn: Callable[..., Any],
    timeout_s: float,
    reports: dict[int, _Report],
) -> DistributedTimeoutError:
    stuck = [rank for rank, p in enumerate(procs) if p.exitcode is None]
    for rank in stuck:
        _signal(procs[rank], signal.SIGUSR1)  # faulthandler dumps all Python stacks
    time.sleep(0.5)
    _kill_all(procs)
    stacks = []
    for rank in stuck:
        path = job_dir / f"stack{rank}.txt"
        text = path.read_text(errors="replace").strip() if path.exists() else ""
        stacks.append(f"\n----- rank {rank} Python stacks -----\n{text or '(no stack dump)'}")
    returned = [rank for rank in stuck if rank in reports]
    exiting = f" (ranks {returned} had returned but not exited)" if returned else ""
    message = (
        f"{_fn_name(fn)} did not finish within timeout_s={timeout_s:g} s; "
        f"ranks still running: {stuck}{exiting}. Every rank was killed. "
        "The usual cause is a collective that not every rank called (or called with "
        "mismatched sizes); the stacks below show where each stuck rank waits. "
        "If the job is merely slow, raise timeout_s." + "".join(stacks)
    )
    return DistributedTimeoutError(message, rank=stuck[0] if stuck else None)


def _died_report(rank: int, proc: Any) -> _Report:
    text = (
        f"rank {rank} exited with code {proc.exitcode} without reporting a result "
        "(crashed, was killed, or called os._exit/sys.exit)"
    )
    return _Report(rank=rank, ok=False, traceback_text=text, finished_at=time.time())


def _read_report(job_dir: Path, rank: int) -> _Report | None:
    path = job_dir / f"result{rank}.pkl"
    if not path.exists():
        return None
    with path.open("rb") as f:
        return pickle.load(f)


def _signal(proc: Any, signum: int) -> None:
    try:
        if proc.pid is not None and proc.exitcode is None:
            os.kill(proc.pid, signum)
    except ProcessLookupError:
        pass


def _kill_all(procs: list[Any]) -> None:
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            p.kill()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=5)


def _fn_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# ----------------------------------------------------------------------------- child side


def _child_main(
    rank: int,
    world_size: int,
    job_dir_s: str,
    parent_pid: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    job_dir = Path(job_dir_s)
    torch.set_num_threads(1)  # world_size ranks share a few cores
    _start_orphan_watchdog(parent_pid)
    stack_file = (job_dir / f"stack{rank}.txt").open("w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        store = dist.FileStore(str(job_dir / "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args, **kwargs)
        dist.destroy_process_group()
        report = _Report(rank=rank, ok=True, value=value, finished_at=time.time())
        _write_report(job_dir, report)
    except BaseException as exc:  # report everything, including KeyboardInterrupt/SystemExit
        report = _Report(
            rank=rank,
            ok=False,
            traceback_text=traceback.format_exc(),
            exception_pickle=_try_pickle(exc),
            finished_at=time.time(),
        )
        _write_report(job_dir, report)
        # The others are likely blocked on this rank: do not wait on them in teardown.
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _try_pickle(exc: BaseException) -> bytes | None:
    try:
        return pickle.dumps(exc)
    except Exception:
        return None


def _write_report(job_dir: Path, report: _Report) -> None:
    try:
        data = pickle.dumps(report)
    except Exception:
        reason = traceback.format_exc()
        report = _Report(
            rank=report.rank,
            ok=False,
            traceback_text=f"the return value of rank {report.rank} does not pickle; "
            f"return plain data (tensors, numbers, lists, dicts):\n{reason}",
            finished_at=report.finished_at,
        )
        data = pickle.dumps(report)
    tmp = job_dir / f"result{report.rank}.pkl.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, job_dir / f"result{report.rank}.pkl")  # atomic: the parent polls it


def _start_orphan_watchdog(parent_pid: int) -> None:
    """Exit if the parent dies (e.g. pytest is SIGKILLed), instead of hanging forever."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, name="orphan-watchdog", daemon=True).start()


def replicated_losses(
    model: torch.nn.Module, loss_at: Callable[[torch.nn.Module, int], torch.Tensor], steps: int
) -> list[float]:
    """The single-process reference of a data-parallel run, on each rank of an initialized
    process group: `steps` AdamW steps (lr 1e-2) of `model` on this rank's loss
    (`loss_at(model, step)`), each gradient averaged over the ranks by hand."""
    import torch.distributed as dist

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    world = dist.get_world_size()
    losses = []
    for step in range(steps):
        loss = loss_at(model, step)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
