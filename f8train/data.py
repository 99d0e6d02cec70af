"""Training data with no download: where the tokens come from and how they split.

``load_tokens`` gives one flat token array (docs/trainer.md lists the sources: a text file, a
folder of text files, a pre-tokenized ``.u16.bin``/``.u32.bin`` file, or the Python standard
library) whose last ``val_fraction`` is the validation split. Text is read as bytes, one
token each; a folder or the stdlib goes through the token cache (``f8train.token_cache``),
a single file is memory-mapped in place. The checks that run before training live here too:
a source that is no regular file, a corpus too small for its validation batches, a token id
beyond the model's vocabulary. Batching the splits is ``f8train.token_batches``'s; its
batchers and the cache's ``CACHE_ENV`` are importable from here as well.
"""

from __future__ import annotations

import functools
import math
import stat
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from f8train.token_batches import (
    TokenBatcher,  # noqa: F401  (importable from here as well)
    ValidationBatches,  # noqa: F401  (importable from here as well)
    val_batches_available,
)
from f8train.token_cache import (
    CACHE_ENV,  # noqa: F401  (importable from here as well)
    binary_text,
    byte_cache,
    default_cache_dir,
    memmap_tokens,
)

BYTE_VOCAB_SIZE = 256
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class TokenData:
    """A flat token array and where its validation split starts."""

    tokens: np.ndarray
    val_start: int
    source: str
    vocab_size: int | None  # 256 for byte-level sources; None when pre-tokenized
    cache: Path | None = None  # the token cache built from a folder or the stdlib

    @property
    def train(self) -> np.ndarray:
        return self.tokens[: self.val_start]

    @property
    def val(self) -> np.ndarray:
        return self.tokens[self.val_start :]


@functools.cache
def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library root and its ``*.py`` files, sorted by relative path (listed
    once per process: the argument checks and the loading both need them)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return root, _sorted_files(root, "*.py")


def _sorted_files(root: Path, pattern: str) -> list[Path]:
    found = {p.relative_to(root).as_posix(): p for p in root.rglob(pattern) if p.is_file()}
    return [found[k] for k in sorted(found) if not _EXCLUDED_DIRS.intersection(k.split("/"))]


def _token_file_dtype(path: Path, token_dtype: str | np.dtype | None) -> np.dtype:
    suffixes = {".u16.bin": "uint16", ".u32.bin": "uint32"}
    name = token_dtype or next((d for k, d in suffixes.items() if path.name.endswith(k)), None)
    if name is None:
        raise ValueError(
            f"cannot tell the token dtype of {path}; expected a name ending in .u16.bin or "
            ".u32.bin, or pass token_dtype='uint16' / 'uint32'"
        )
    if np.dtype(name) not in (np.dtype(np.uint16), np.dtype(np.uint32)):
        raise ValueError(
            f"token_dtype={token_dtype!r}; expected uint16 or uint32 for a .bin token file"
        )
    return np.dtype(name)


def _load_source(
    data: Path | None, cache_dir: Path, token_dtype: str | np.dtype | None
) -> tuple[np.ndarray, str, int | None]:
    """The token array, a description and the vocab size (None if pre-tokenized)."""
    if data is None:
        root, files = stdlib_files()
        version = f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}"
        return byte_cache(root, files, cache_dir, version), f"stdlib {root}", BYTE_VOCAB_SIZE
    if not data.exists():
        raise FileNotFoundError(
            f"--data {data} does not exist; expected a text file, a folder of text files or "
            "a .u16.bin/.u32.bin token file (omit --data to use the Python stdlib corpus)"
        )
    if (problem := not_regular(data)) is not None:
        raise ValueError(f"--data {problem}")
    if data.is_dir():
        files = _sorted_files(data, "*")
        if not files:
            raise ValueError(f"--data folder {data} contains no files; expected text files")
        prefix = f"dir-{data.resolve().name}"
        tokens = byte_cache(data, files, cache_dir, prefix, text_only=True)
        return tokens, f"folder {data}", BYTE_VOCAB_SIZE
    if data.name.endswith(".bin") or token_dtype is not None:
        return memmap_tokens(data, _token_file_dtype(data, token_dtype)), f"tokens {data}", None
    # a token file (ids below 256 have zero high bytes) almost always holds NUL bytes
    with open(data, "rb") as f:
        at = f.read(1 << 20).find(b"\0")
    if at >= 0:
        raise ValueError(
            f"--data {data} {binary_text(at)} here. Name it *.u16.bin or *.u32.bin, or "
            "pass --token-dtype uint16/uint32; a text file must have no NUL bytes"
        )
    return memmap_tokens(data, np.dtype(np.uint8)), f"text {data}", BYTE_VOCAB_SIZE


def not_regular(path: Path) -> str | None:
    """Why ``path`` cannot be read as ``--data`` (None: a regular file or a folder), from
    ``stat`` alone: opening a named pipe that has no writer blocks for ever."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return (
            f"{path} does not exist; expected a text file, a folder of text files or a "
            ".u16.bin/.u32.bin token file (omit --data to use the Python stdlib corpus)"
        )
    except OSError as err:
        return f"{path} cannot be read ({err.strerror}); check its permissions"
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kind = (
        "a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    )
    return (
        f"{path} is not a regular file or a folder ({kind}), which the trainer reads several "
        "times and whose size it needs (a pipe without a writer would block in open); "
        "write the data to a file and pass that"
    )


def corpus_tokens(data: str | Path | None, token_dtype: str | None = None) -> int | None:
    """How many tokens ``load_tokens(data)`` gives, from file sizes (nothing is opened);
    None when the file's token dtype cannot be told (``load_tokens`` then says why)."""
    if data is None:
        return sum(p.stat().st_size for p in stdlib_files()[1])
    path = Path(data)
    if path.is_dir():
        return sum(p.stat().st_size for p in _sorted_files(path, "*"))
    if path.name.endswith(".bin") or token_dtype is not None:
        try:
            return path.stat().st_size // _token_file_dtype(path, token_dtype).itemsize
        except ValueError:
            return None
    return path.stat().st_size


def val_tokens(n_tokens: int, val_fraction: float) -> int:
    """The length of the validation split of ``n_tokens`` (its last ``val_fraction``)."""
    return max(1, int(n_tokens * val_fraction))


def min_corpus_tokens(
    *, val_fraction: float, seq_len: int, global_batch: int, val_batches: int
) -> int:
    """The fewest tokens whose validation split holds ``val_batches`` batches and whose
    training split holds one window."""
    n = math.ceil((val_batches * seq_len * global_batch + 1) / val_fraction)
    while (
        n > 1
        and val_batches_available(val_tokens(n - 1, val_fraction), seq_len, global_batch)
        >= val_batches
    ):
        n -= 1
    while (
        val_batches_available(val_tokens(n, val_fraction), seq_len, global_batch) < val_batches
        or n - val_tokens(n, val_fraction) < seq_len + 1
    ):
        n += 1
    return n


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
    tokens, source, vocab = _load_source(None if data is None else Path(data), cache, token_dtype)
    val_start = len(tokens) - val_tokens(len(tokens), val_fraction)
    cached = data is None or Path(data).is_dir()  # else the file itself, read in place
    built = Path(tokens.filename) if cached and isinstance(tokens, np.memmap) else None
    return TokenData(tokens, val_start, source, vocab, built)


def check_token_ids(data: TokenData, vocab_size: int) -> None:
    """Every token id must index the model's embedding, checked at load rather than as an
    IndexError at step 1 (a pre-tokenized file is scanned once for its largest id)."""
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
