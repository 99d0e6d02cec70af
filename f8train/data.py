"""Training data with no download: byte-level tokens, deterministic batches for any world size.

``load_tokens`` gives one flat token array (docs/trainer.md lists the sources) whose last
``val_fraction`` is the validation split. ``TokenBatcher``: step ``s``'s global batch is
``global_batch`` windows of ``seq_len + 1`` tokens at offsets drawn from
``numpy.random.default_rng([seed, s])``, rank ``r`` taking rows ``[r * local, (r + 1) *
local)``: the batches never depend on the world size, so a run resumes at any world size.
``ValidationBatches``: fixed consecutive windows from the start of the validation split.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
import stat
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

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


CACHE_ENV = "FSDP_FLOAT8_CACHE_DIR"


def default_cache_dir() -> Path:
    """Where a folder's or the stdlib's token cache goes without ``--cache-dir``:
    ``$FSDP_FLOAT8_CACHE_DIR``, else ``$XDG_CACHE_HOME/fsdp_float8``, else
    ``~/.cache/fsdp_float8``."""
    if mine := os.environ.get(CACHE_ENV):
        return Path(mine)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fsdp_float8"


@functools.cache
def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library root and its ``*.py`` files, sorted by relative path (listed
    once per process: the argument checks and the loading both need them)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return root, _sorted_files(root, "*.py")


def _sorted_files(root: Path, pattern: str) -> list[Path]:
    found = {p.relative_to(root).as_posix(): p for p in root.rglob(pattern) if p.is_file()}
    return [found[k] for k in sorted(found) if not _EXCLUDED_DIRS.intersection(k.split("/"))]


_CHUNK = 1 << 24  # 16 MiB: the most of a file held in memory at once
_CACHE_MARGIN = 1.05  # the free space a cache build needs beyond its size


def _free_bytes(path: Path) -> int:
    """Free bytes on the file system of ``path`` (its nearest existing parent)."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    return shutil.disk_usage(existing).free


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


def _check_text(root: Path, path: Path, chunk: bytes, offset: int) -> None:
    if (at := chunk.find(b"\0")) >= 0:
        raise ValueError(
            f"--data folder {root}: {path} {_binary_text(offset + at)}; move it out of "
            "the folder (a folder is read as text files), or pass a token file alone as --data"
        )


def _file_digest(path: Path, root: Path, text_only: bool) -> str:
    """The sha256 of a file's bytes, read a chunk at a time; ``text_only``: a NUL byte stops
    the read, naming the file."""
    digest, offset = hashlib.sha256(), 0
    for chunk in _chunks(path):
        if text_only:
            _check_text(root, path, chunk, offset)
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def _content_key(
    root: Path, files: list[Path], cache_dir: Path, prefix: str, text_only: bool
) -> str:
    """A fingerprint of ``files``' names and contents. Each file's sha256 is kept in an index
    next to the cache, with the stat record it was read under (size, mtime, ctime, inode):
    an unchanged file is not read again, and any write changes its ctime, which no tool sets
    back, so a same-size edit is read and hashed anew. A build needs room for two bytes per
    byte of text: checked before any file is read."""
    where = hashlib.sha256(os.fsencode(root.resolve())).hexdigest()[:16]
    index_path = cache_dir / f"{prefix}-{where}.index.json"
    try:
        index = json.loads(index_path.read_text())
        index = index if isinstance(index, dict) else {}
    except (OSError, ValueError):
        index = {}
    names = [p.relative_to(root).as_posix() for p in files]
    stats = [p.stat() for p in files]
    records = [[s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino] for s in stats]
    known: list[str | None] = []
    for name, record in zip(names, records, strict=True):
        entry = index.get(name)
        fits = isinstance(entry, list) and len(entry) == 5 and entry[:4] == record
        known.append(entry[4] if fits else None)
    if None in known:  # something to read: maybe a build after it
        need = int(2 * sum(s.st_size for s in stats) * _CACHE_MARGIN)
        if _free_bytes(cache_dir) < need:
            total = sum(s.st_size for s in stats)
            raise ValueError(
                f"the token cache of {root} ({total:,} bytes of text, {need:,} bytes as "
                f"uint16 tokens) does not fit in {cache_dir} ({_free_bytes(cache_dir):,} bytes "
                f"free); free space there, or put the cache elsewhere with --cache-dir or "
                f"{CACHE_ENV}"
            )
    digests = [
        sha if sha is not None else _file_digest(path, root, text_only)
        for path, sha in zip(files, known, strict=True)
    ]
    if known != digests:
        entries = {n: [*r, d] for n, r, d in zip(names, records, digests, strict=True)}
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = index_path.with_name(f"{index_path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(entries) + "\n")
        os.replace(tmp, index_path)
    listing = "".join(f"{n}\t{s.st_size}\t{d}\n" for n, s, d in zip(names, stats, digests))
    return hashlib.sha256(listing.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def _byte_cache(
    root: Path, files: list[Path], cache_dir: Path, prefix: str, *, text_only: bool = False
) -> np.ndarray:
    """``files`` concatenated as bytes into a uint16 token file named by a fingerprint of
    their names and contents (``_content_key``; built once, a chunk at a time; atomic
    rename), memory-mapped. ``text_only``: a file holding a NUL byte stops the build, naming
    it (a binary file would train as text)."""
    key = _content_key(root, files, cache_dir, prefix, text_only)
    cache_path = cache_dir / f"{prefix}-{key}.u16.bin"
    if not cache_path.exists():
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_path.with_name(f"{cache_path.name}.tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as out:
                for path in files:
                    offset = 0
                    for chunk in _chunks(path):
                        if text_only:
                            _check_text(root, path, chunk, offset)
                        out.write(np.frombuffer(chunk, dtype=np.uint8).astype(np.uint16))
                        offset += len(chunk)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, cache_path)
    return _memmap(cache_path, np.dtype(np.uint16))


def _binary_text(at: int) -> str:
    return (
        f"holds NUL bytes (the first at byte {at}): it looks like a binary token file, "
        "which would train as text"
    )


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
        version = f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}"
        return _byte_cache(root, files, cache_dir, version), f"stdlib {root}", BYTE_VOCAB_SIZE
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
        tokens = _byte_cache(data, files, cache_dir, prefix, text_only=True)
        return tokens, f"folder {data}", BYTE_VOCAB_SIZE
    if data.name.endswith(".bin") or token_dtype is not None:
        return _memmap(data, _token_file_dtype(data, token_dtype)), f"tokens {data}", None
    # a token file (ids below 256 have zero high bytes) almost always holds NUL bytes
    with open(data, "rb") as f:
        at = f.read(1 << 20).find(b"\0")
    if at >= 0:
        raise ValueError(
            f"--data {data} {_binary_text(at)} here. Name it *.u16.bin or *.u32.bin, or "
            "pass --token-dtype uint16/uint32; a text file must have no NUL bytes"
        )
    return _memmap(data, np.dtype(np.uint8)), f"text {data}", BYTE_VOCAB_SIZE


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


def val_batches_available(n_val: int, seq_len: int, global_batch: int) -> int:
    """Validation batches of ``global_batch`` windows of ``seq_len + 1`` tokens in a split
    of ``n_val`` tokens (consecutive windows overlap by one token)."""
    return (n_val - 1) // (seq_len * global_batch)


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
