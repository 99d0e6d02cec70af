"""Batches cut from a flat token array, the same for any world size.

A batch is ``global_batch`` windows of ``seq_len + 1`` tokens (inputs, and targets shifted by
one); rank ``r`` of ``world_size`` takes rows ``[r * local, (r + 1) * local)`` with
``local = global_batch // world_size``. ``TokenBatcher`` draws step ``s``'s window offsets
from ``numpy.random.default_rng([seed, s])``, so the batches never depend on the world size
and a run resumes at any world size from the step number alone. ``ValidationBatches`` are
fixed consecutive windows from the start of the validation split.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch


def val_batches_available(n_val: int, seq_len: int, global_batch: int) -> int:
    """Validation batches of ``global_batch`` windows of ``seq_len + 1`` tokens in a split
    of ``n_val`` tokens (consecutive windows overlap by one token)."""
    return (n_val - 1) // (seq_len * global_batch)


def _windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> tuple[torch.Tensor, ...]:
    index = offsets[:, None] + np.arange(seq_len + 1)
    rows = torch.from_numpy(np.asarray(tokens[index], dtype=np.int64))
    return rows[:, :-1], rows[:, 1:]


class _Layout:
    """This rank's ``local_batch`` rows of a ``global_batch`` of ``seq_len`` windows."""

    def __init__(self, tokens, *, seq_len: int, global_batch: int, rank=0, world_size=1) -> None:
        for name, value in (("seq_len", seq_len), ("global_batch", global_batch)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}; expected a positive int")
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(
                f"rank={rank}, world_size={world_size}; expected 0 <= rank < world_size"
            )
        if global_batch % world_size != 0:
            raise ValueError(
                f"global_batch={global_batch} is not divisible by world_size={world_size}; "
                f"choose a global batch that is a multiple of {world_size}"
            )
        self.tokens, self.seq_len, self.global_batch = tokens, seq_len, global_batch
        self.rank, self.local_batch = rank, global_batch // world_size

    def mine(self, global_rows: np.ndarray) -> np.ndarray:
        return global_rows[self.rank * self.local_batch : (self.rank + 1) * self.local_batch]


class TokenBatcher(_Layout):
    """Iterator of ``(inputs, targets)``, each ``(local_batch, seq_len)`` int64 on the CPU."""

    def __init__(
        self, tokens: np.ndarray, *, seed: int = 0, batch_change: bool = False, **layout
    ) -> None:
        super().__init__(tokens, **layout)
        self.batch_change = batch_change  # a loaded state may hold another global_batch
        if len(tokens) < self.seq_len + 1:
            raise ValueError(
                f"the training split has {len(tokens)} tokens, fewer than seq_len + 1 = "
                f"{self.seq_len + 1}; use a larger corpus or a shorter seq_len"
            )
        self.seed, self.step = seed, 0

    def global_offsets(self, step: int) -> np.ndarray:
        """Start offsets of all ``global_batch`` windows of ``step`` (same on every rank)."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.global_batch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = self.mine(self.global_offsets(self.step))
        self.step += 1
        return _windows(self.tokens, offsets, self.seq_len)

    def state_dict(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in ("step", "seed", "seq_len", "global_batch")}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at ``state["step"]``; the batch layout must match (world size may differ;
        ``global_batch`` too with ``batch_change``)."""
        keys = ("seed", "seq_len") if self.batch_change else ("seed", "seq_len", "global_batch")
        for key in keys:
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"batcher state has {key}={state[key]} but this batcher has "
                    f"{key}={getattr(self, key)}; resume with the same {key} to replay the "
                    "same batches"
                )
        self.step = int(state["step"])


class ValidationBatches(_Layout):
    """Fixed validation batches: consecutive non-overlapping windows, re-iterable."""

    def __init__(self, tokens: np.ndarray, *, num_batches: int | None = None, **layout) -> None:
        super().__init__(tokens, **layout)
        available = val_batches_available(len(tokens), self.seq_len, self.global_batch)
        if available == 0 or (num_batches is not None and not 0 < num_batches <= available):
            raise ValueError(
                f"the validation split ({len(tokens)} tokens) holds {available} batches of "
                f"{self.global_batch} x {self.seq_len + 1} tokens but "
                f"{num_batches or 'at least 1'} were asked for; use fewer/smaller batches or "
                "a larger val_fraction"
            )
        self.num_batches = available if num_batches is None else num_batches

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in range(self.num_batches):
            rows = self.mine(np.arange(index * self.global_batch, (index + 1) * self.global_batch))
            yield _windows(self.tokens, rows * self.seq_len, self.seq_len)
