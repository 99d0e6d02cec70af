"""The caller's stream: where the float8 step runs, whoever calls it.

The step's refreshes write state that casts on the caller's stream read: precomputed weight
scales, delayed-scaling buffers. Most refreshes run from hooks on that stream (the root's
forward pre-hook, the optimizer step hook), but one runs from FSDP2's pre-all-gather hook,
which FSDP2 calls on its all-gather copy-in stream. `on_stream` moves that one back to the
caller's stream and makes the copy-in stream wait for it, so the hook's own cast sees the
refreshed scale and the caller's casts are ordered after the writes. (On CPU `torch.cpu`
keeps a current stream too, and FSDP2 switches it the same way, so the placement is
testable without a GPU.)
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch

Stream = Any  # torch.Stream, or torch.cpu.Stream (a stand-in class of its own)


def caller_stream() -> Stream:
    """The current stream of the accelerator (of the CPU without one)."""
    if torch.accelerator.is_available():
        return torch.accelerator.current_stream()
    return torch.cpu.current_stream()


def first_stream() -> Stream | None:
    """The stream to assume before the caller's is recorded: the CPU's current one; None
    with an accelerator (asking for its stream at conversion could create a context on
    device 0 before the script picks its device; `on_stream` then takes the default)."""
    return None if torch.accelerator.is_available() else torch.cpu.current_stream()


@contextmanager
def on_stream(stream: Stream | None):
    """Run the body on `stream` (the caller's, recorded by a hook that runs on it; None:
    the accelerator's default stream), then make the stream that was current wait for it."""
    # a CUDA build of torch on a machine without a GPU names cuda as its accelerator though
    # none is available: there the streams are the CPU's, as in `caller_stream`
    handle: Any = torch.cpu
    if torch.accelerator.is_available():
        handle = torch.get_device_module(torch.accelerator.current_accelerator())
    if stream is None:
        stream = handle.default_stream()
    current = caller_stream()
    if current == stream:
        yield
        return
    with handle.stream(stream):
        yield
    current.wait_stream(stream)
