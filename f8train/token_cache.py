"""The byte-level token cache: text files turned once into a memory-mapped uint16 file.

A folder of text (or the Python standard library) becomes one flat ``*.u16.bin`` file, one
token per byte, under the cache folder (``default_cache_dir``). Its name carries a
fingerprint of the files' names and contents, so a changed corpus builds a new cache and an
unchanged one is reused. The fingerprint reads each file's sha256 from an index kept next to
the cache, keyed by the file's stat record, so only new or touched files are read again.
Every read goes a chunk at a time, so no file is ever held whole in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

CACHE_ENV = "FSDP_FLOAT8_CACHE_DIR"
_CHUNK = 1 << 24  # 16 MiB: the most of a file held in memory at once
_CACHE_MARGIN = 1.05  # the free space a cache build needs beyond its size


def default_cache_dir() -> Path:
    """Where a folder's or the stdlib's token cache goes without ``--cache-dir``:
    ``$FSDP_FLOAT8_CACHE_DIR``, else ``$XDG_CACHE_HOME/fsdp_float8``, else
    ``~/.cache/fsdp_float8``."""
    if mine := os.environ.get(CACHE_ENV):
        return Path(mine)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fsdp_float8"


def _free_bytes(path: Path) -> int:
    """Free bytes on the file system of ``path`` (its nearest existing parent)."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    return shutil.disk_usage(existing).free


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


def binary_text(at: int) -> str:
    """The complaint about a text source that holds a NUL byte at offset ``at``."""
    return (
        f"holds NUL bytes (the first at byte {at}): it looks like a binary token file, "
        "which would train as text"
    )


def _check_text(root: Path, path: Path, chunk: bytes, offset: int) -> None:
    if (at := chunk.find(b"\0")) >= 0:
        raise ValueError(
            f"--data folder {root}: {path} {binary_text(offset + at)}; move it out of "
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


def byte_cache(
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
    return memmap_tokens(cache_path, np.dtype(np.uint16))


def memmap_tokens(path: Path, dtype: np.dtype) -> np.ndarray:
    """The token file ``path`` memory-mapped read-only as ``dtype``, refused when empty or
    when its size is no whole number of tokens."""
    size = path.stat().st_size
    if size % dtype.itemsize != 0:
        raise ValueError(
            f"{path} has {size} bytes, not a multiple of {dtype.itemsize} ({dtype.name}); "
            "check the token dtype or the file"
        )
    if size == 0:
        raise ValueError(f"{path} is empty; expected at least one token")
    return np.memmap(path, dtype=dtype, mode="r")
