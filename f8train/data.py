"""Training data with no download: byte-level tokens, deterministic batches for any world size.

Run ``python -m f8train.data [--data PATH] [--cache-dir DIR]`` to build the cache ahead of
time and print the corpus statistics.

Mental model:

* A corpus is one flat 1-D token array (``TokenData.tokens``; a numpy memmap when it comes
  from a file) plus ``val_start``: tokens ``[0, val_start)`` are the training split and
  ``[val_start, n)`` the validation split. The split is positional: validation is the last
  ``val_fraction`` (default 1%) of the token stream, so the two never overlap.
* Sources (``load_tokens``): by default the ``*.py`` files of the running Python's standard
  library (``sysconfig.get_paths()["stdlib"]``, ``site-packages``/``dist-packages``
  excluded), sorted by relative path and concatenated as bytes; a text file (its bytes,
  memory-mapped as uint8); a folder of text files (recursive, sorted by relative path); or a
  pre-tokenized ``.bin`` file (or any file with ``token_dtype``), a flat uint16/uint32
  array whose dtype comes from the ``token_dtype`` argument or the suffix ``.u16.bin`` /
  ``.u32.bin``. A text file holding NUL bytes is refused (a token file named otherwise).
  Byte-level means the token id is the byte value (vocab 256). Concatenated corpora are cached as a flat uint16
  ``.u16.bin`` under ``~/.cache/fsdp_float8/`` (or ``cache_dir``), named by a fingerprint of
  the file list and sizes; the file is written to a temporary name and renamed, so ranks
  that build it at the same time do not see partial files.
* ``TokenBatcher``: the global batch at step ``s`` is ``global_batch`` windows of
  ``seq_len + 1`` tokens starting at offsets drawn by ``numpy.random.default_rng([seed, s])``;
  rank ``r`` of ``world_size`` takes rows ``[r * local, (r + 1) * local)``. The global batch
  therefore depends only on (corpus, seed, step, global_batch, seq_len), never on the world
  size, and the only state is the step counter (``state_dict``/``load_state_dict``), so a
  resumed run, even at another world size, sees exactly the batches it would have seen.
* ``ValidationBatches``: fixed, non-overlapping consecutive windows from the start of the
  validation split; every iteration yields the same batches.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "BYTE_VOCAB_SIZE",
    "TokenBatcher",
    "TokenData",
    "ValidationBatches",
    "add_data_args",
    "build_token_cache",
    "check_token_ids",
    "default_cache_dir",
    "load_tokens",
    "load_tokens_from_args",
    "stdlib_files",
]

BYTE_VOCAB_SIZE = 256
_SUFFIX_DTYPES = {".u16.bin": np.uint16, ".u32.bin": np.uint32}
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class TokenData:
    """A flat token array and where its validation split starts."""

    tokens: np.ndarray
    val_start: int
    source: str
    vocab_size: int | None  # 256 for byte-level sources; None when pre-tokenized

    @property
    def train(self) -> np.ndarray:
        return self.tokens[: self.val_start]

    @property
    def val(self) -> np.ndarray:
        return self.tokens[self.val_start :]


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "fsdp_float8"


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library root and its ``*.py`` files, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return root, _sorted_files(root, "*.py")


def _sorted_files(root: Path, pattern: str) -> list[Path]:
    files = [
        path
        for path in root.rglob(pattern)
        if path.is_file() and not _EXCLUDED_DIRS.intersection(path.relative_to(root).parts)
    ]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def _fingerprint(root: Path, files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.relative_to(root).as_posix()}\t{path.stat().st_size}\n".encode())
    return digest.hexdigest()[:16]


def build_token_cache(root: Path, files: list[Path], cache_path: Path) -> Path:
    """Concatenate ``files`` as bytes into a flat uint16 token file (once; atomic rename)."""
    if cache_path.exists():
        return cache_path
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_path.with_name(f"{cache_path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as out:
        for path in files:
            out.write(np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.uint16))
    os.replace(tmp, cache_path)
    return cache_path


def _token_file_dtype(path: Path, token_dtype: str | np.dtype | None) -> np.dtype:
    if token_dtype is not None:
        dtype = np.dtype(token_dtype)
        if dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)):
            raise ValueError(
                f"token_dtype={token_dtype!r}; expected uint16 or uint32 for a .bin token file"
            )
        return dtype
    for suffix, dtype in _SUFFIX_DTYPES.items():
        if path.name.endswith(suffix):
            return np.dtype(dtype)
    raise ValueError(
        f"cannot tell the token dtype of {path}; expected a name ending in .u16.bin or "
        ".u32.bin, or pass token_dtype='uint16' / 'uint32'"
    )


def _memmap(path: Path, dtype: np.dtype) -> np.ndarray:
    size = path.stat().st_size
    if size % dtype.itemsize != 0:
        raise ValueError(
            f"{path} has {size} bytes, not a multiple of {dtype.itemsize} ({dtype.name}); "
            "check the token dtype or the file"
        )
    if size == 0:
        raise ValueError(f"{path} is empty; expected at least one token")
    return np.memmap(path, dtype=dtype, mode="r")


def _load_source(
    data: Path | None, cache_dir: Path, token_dtype: str | np.dtype | None
) -> tuple[np.ndarray, str, int | None]:
    """The token array, a description and the vocab size (None if pre-tokenized)."""
    if data is None:
        root, files = stdlib_files()
        version = f"py{sys.version_info.major}.{sys.version_info.minor}"
        name = f"stdlib-{version}-{_fingerprint(root, files)}.u16.bin"
        path = build_token_cache(root, files, cache_dir / name)
        return _memmap(path, np.dtype(np.uint16)), f"stdlib {root}", BYTE_VOCAB_SIZE
    if not data.exists():
        raise FileNotFoundError(
            f"--data {data} does not exist; expected a text file, a folder of text files or "
            "a .u16.bin/.u32.bin token file (omit --data to use the Python stdlib corpus)"
        )
    if data.is_dir():
        files = _sorted_files(data, "*")
        if not files:
            raise ValueError(f"--data folder {data} contains no files; expected text files")
        name = f"dir-{data.resolve().name}-{_fingerprint(data, files)}.u16.bin"
        path = build_token_cache(data, files, cache_dir / name)
        return _memmap(path, np.dtype(np.uint16)), f"folder {data}", BYTE_VOCAB_SIZE
    if data.name.endswith(".bin") or token_dtype is not None:
        return _memmap(data, _token_file_dtype(data, token_dtype)), f"tokens {data}", None
    _refuse_binary(data)
    return _memmap(data, np.dtype(np.uint8)), f"text {data}", BYTE_VOCAB_SIZE


def _refuse_binary(path: Path, probe: int = 1 << 20) -> None:
    """A text file has no NUL bytes; a token file (uint16/uint32 ids below 256 have zero
    high bytes) almost always has them. Read as text it would train on its raw bytes."""
    with open(path, "rb") as f:
        head = f.read(probe)
    at = head.find(b"\0")
    if at >= 0:
        raise ValueError(
            f"--data {path} holds NUL bytes (the first at byte {at}): it looks like a binary "
            "token file, which would train as text here. Name it *.u16.bin or *.u32.bin, or "
            "pass --token-dtype uint16/uint32; a text file must have no NUL bytes"
        )


def load_tokens(
    data: str | Path | None = None,
    *,
    cache_dir: str | Path | None = None,
    token_dtype: str | np.dtype | None = None,
    val_fraction: float = 0.01,
) -> TokenData:
    """Load a corpus (see the module docstring for sources) and split it positionally."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction}; expected a float in (0, 1)")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    tokens, source, vocab_size = _load_source(
        None if data is None else Path(data), cache, token_dtype
    )
    n = len(tokens)
    val_start = n - max(1, int(n * val_fraction))
    return TokenData(tokens=tokens, val_start=val_start, source=source, vocab_size=vocab_size)


def check_token_ids(data: TokenData, vocab_size: int) -> None:
    """Every token id must index the model's embedding (``0 <= id < vocab_size``): checked
    when the data is loaded, not as an IndexError from the embedding at step 1. Byte-level
    sources have ids below 256; a pre-tokenized file is scanned once for its largest id."""
    if data.vocab_size is not None:
        if data.vocab_size > vocab_size:
            raise ValueError(
                f"the data ({data.source}) has a vocabulary of {data.vocab_size} but the "
                f"model's is {vocab_size}; pick a --preset whose vocab_size covers the data"
            )
        return
    largest = int(data.tokens.max())
    if largest >= vocab_size:
        where = int(np.argmax(data.tokens >= vocab_size))
        raise ValueError(
            f"{data.source}: token id {largest} is outside the model's vocabulary of "
            f"{vocab_size} (ids 0..{vocab_size - 1}; the first id out of range is at token "
            f"{where:,}); pick a --preset whose vocab_size is above {largest}, or check the "
            "tokenizer and --token-dtype of the file"
        )


def _check_layout(
    num_tokens: int, seq_len: int, global_batch: int, rank: int, world_size: int, what: str
) -> None:
    for name, value in (("seq_len", seq_len), ("global_batch", global_batch)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r}; expected a positive int")
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}, world_size={world_size}; expected 0 <= rank < world_size")
    if global_batch % world_size != 0:
        raise ValueError(
            f"global_batch={global_batch} is not divisible by world_size={world_size}; "
            f"choose a global batch that is a multiple of {world_size}"
        )
    if num_tokens < seq_len + 1:
        raise ValueError(
            f"the {what} has {num_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
            "use a larger corpus (or a larger val_fraction) or a shorter seq_len"
        )


def _windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> tuple[torch.Tensor, ...]:
    index = offsets[:, None] + np.arange(seq_len + 1)
    rows = torch.from_numpy(np.asarray(tokens[index], dtype=np.int64))
    return rows[:, :-1], rows[:, 1:]


class TokenBatcher:
    """Iterator of ``(inputs, targets)``, each ``(local_batch, seq_len)`` int64 on the CPU."""

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        seq_len: int,
        global_batch: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ) -> None:
        _check_layout(len(tokens), seq_len, global_batch, rank, world_size, "training split")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.step = 0

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.world_size

    def global_offsets(self, step: int) -> np.ndarray:
        """Start offsets of all ``global_batch`` windows of ``step`` (same on every rank)."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.global_batch)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the global batch at ``step`` (does not move the counter)."""
        start = self.rank * self.local_batch
        offsets = self.global_offsets(step)[start : start + self.local_batch]
        return _windows(self.tokens, offsets, self.seq_len)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        inputs_targets = self.batch(self.step)
        self.step += 1
        return inputs_targets

    def state_dict(self) -> dict[str, int]:
        return {
            "step": self.step,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at ``state["step"]``; the batch layout must match (world size may differ)."""
        for key in ("seed", "seq_len", "global_batch"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"batcher state has {key}={state[key]} but this batcher has "
                    f"{key}={getattr(self, key)}; resume with the same {key} to replay the "
                    "same batches"
                )
        self.step = int(state["step"])


class ValidationBatches:
    """Fixed validation batches: consecutive non-overlapping windows, re-iterable."""

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        seq_len: int,
        global_batch: int,
        rank: int = 0,
        world_size: int = 1,
        num_batches: int | None = None,
    ) -> None:
        _check_layout(len(tokens), seq_len, global_batch, rank, world_size, "validation split")
        available = (len(tokens) - 1) // (seq_len * global_batch)
        if available == 0 or (num_batches is not None and not 0 < num_batches <= available):
            raise ValueError(
                f"the validation split ({len(tokens)} tokens) holds {available} batches of "
                f"{global_batch} x {seq_len + 1} tokens but {num_batches or 'at least 1'} "
                "were asked for; use fewer/smaller batches or a larger val_fraction"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.local_batch = global_batch // world_size
        self.rank = rank
        self.num_batches = available if num_batches is None else num_batches

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in range(self.num_batches):
            first_row = index * self.global_batch + self.rank * self.local_batch
            rows = np.arange(first_row, first_row + self.local_batch)
            yield _windows(self.tokens, rows * self.seq_len, self.seq_len)


def add_data_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--data``, ``--cache-dir``, ``--token-dtype`` and ``--val-fraction``."""
    parser.add_argument(
        "--data",
        default=None,
        help="text file, folder of text files, or .u16.bin/.u32.bin token file "
        "(default: the Python stdlib sources)",
    )
    parser.add_argument("--cache-dir", default=None, help=f"default {default_cache_dir()}")
    parser.add_argument("--token-dtype", default=None, choices=["uint16", "uint32"])
    parser.add_argument("--val-fraction", type=_fraction, default=0.01, help="in (0, 1)")


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}")
    return value


def load_tokens_from_args(args: argparse.Namespace) -> TokenData:
    return load_tokens(
        args.data,
        cache_dir=args.cache_dir,
        token_dtype=args.token_dtype,
        val_fraction=args.val_fraction,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_args(parser)
    data = load_tokens_from_args(parser.parse_args(argv))
    print(
        f"{data.source}: {len(data.tokens):,} tokens ({data.tokens.dtype}), "
        f"train {len(data.train):,}, validation {len(data.val):,}, vocab {data.vocab_size}"
    )
    if isinstance(data.tokens, np.memmap):
        print(f"token file: {data.tokens.filename}")


if __name__ == "__main__":
    main()
