"""Data pipeline: corpus sources and caching, split, world-size-independent batches, resume."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from f8train import token_cache
from f8train.data import TokenData, load_tokens, stdlib_files
from f8train.token_batches import TokenBatcher, ValidationBatches
from f8train.token_cache import default_cache_dir


@pytest.fixture(scope="module")
def stdlib_data(tmp_path_factory: pytest.TempPathFactory) -> TokenData:
    return load_tokens(cache_dir=tmp_path_factory.mktemp("cache"))


def _corpus(n: int = 10_000) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=n).astype(np.uint16)


def test_stdlib_corpus_builds_and_caches(stdlib_data: TokenData) -> None:
    root, files = stdlib_files()
    assert files == sorted(files, key=lambda p: p.relative_to(root).as_posix())
    assert not any("site-packages" in p.parts for p in files)
    tokens = stdlib_data.tokens
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    assert len(tokens) == sum(p.stat().st_size for p in files) > 1_000_000
    assert stdlib_data.vocab_size == 256 and int(tokens[:100_000].max()) < 256
    first = np.frombuffer(files[0].read_bytes(), dtype=np.uint8)
    assert np.array_equal(tokens[: len(first)], first)
    cache_file = Path(tokens.filename)
    assert cache_file.name.endswith(".u16.bin")
    mtime = cache_file.stat().st_mtime_ns
    again = load_tokens(cache_dir=cache_file.parent)  # second load reuses the cache
    assert cache_file.stat().st_mtime_ns == mtime
    assert len(again.tokens) == len(tokens)


def test_split_is_disjoint_and_covers(stdlib_data: TokenData) -> None:
    n = len(stdlib_data.tokens)
    assert len(stdlib_data.train) + len(stdlib_data.val) == n
    assert stdlib_data.val_start == n - int(n * 0.01)
    assert np.shares_memory(stdlib_data.train, stdlib_data.tokens)
    # Batches never read past the train split: offsets stay below len(train) - seq_len.
    batcher = TokenBatcher(stdlib_data.train, seq_len=128, global_batch=64, seed=3)
    assert all(batcher.global_offsets(s).max() + 128 < stdlib_data.val_start for s in range(20))


@pytest.mark.parametrize("seed", [0, 7])
def test_global_batch_is_independent_of_world_size(seed: int) -> None:
    tokens = _corpus()
    reference = None
    for world_size in (1, 2, 4):
        batchers = [
            TokenBatcher(
                tokens, seq_len=16, global_batch=8, rank=r, world_size=world_size, seed=seed
            )
            for r in range(world_size)
        ]
        steps = []
        for _ in range(3):
            parts = [next(b) for b in batchers]
            steps.append(tuple(torch.cat(p) for p in zip(*parts)))
        if reference is None:
            reference = steps
        for (x, y), (rx, ry) in zip(steps, reference):
            assert torch.equal(x, rx) and torch.equal(y, ry)
    x, y = reference[0]
    assert x.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    assert not torch.equal(reference[0][0], reference[1][0])  # steps differ


def test_batcher_resume_round_trip() -> None:
    tokens = _corpus()
    first = TokenBatcher(tokens, seq_len=16, global_batch=4, seed=5)
    for _ in range(3):
        next(first)
    state = first.state_dict()
    expected = [next(first) for _ in range(2)]
    # Resume at a different world size: rank 1 of 2 sees the second half of each batch.
    resumed = TokenBatcher(tokens, seq_len=16, global_batch=4, rank=1, world_size=2, seed=5)
    resumed.load_state_dict(state)
    assert resumed.step == 3
    for (x, y), (rx, ry) in zip(expected, [next(resumed) for _ in range(2)]):
        assert torch.equal(x[2:], rx) and torch.equal(y[2:], ry)
    other_seed = TokenBatcher(tokens, seq_len=16, global_batch=4, seed=6)
    with pytest.raises(ValueError, match="seed=5"):
        other_seed.load_state_dict(state)


def test_validation_batches_are_fixed_and_sharded() -> None:
    tokens = _corpus(1000)
    full = ValidationBatches(tokens, seq_len=10, global_batch=4)
    assert len(full) == (1000 - 1) // 40
    first_pass, second_pass = list(full), list(full)
    for (x, y), (x2, y2) in zip(first_pass, second_pass):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    x0, _ = first_pass[0]
    assert torch.equal(x0.flatten(), torch.from_numpy(tokens[:40].astype(np.int64)))
    halves = [
        list(
            ValidationBatches(
                tokens, seq_len=10, global_batch=4, rank=r, world_size=2, num_batches=3
            )
        )
        for r in range(2)
    ]
    for index in range(3):
        joined = torch.cat([halves[0][index][0], halves[1][index][0]])
        assert torch.equal(joined, first_pass[index][0])


def test_text_file_input(tmp_path: Path) -> None:
    text = "hello float8 world\n" * 50
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    data = load_tokens(path, cache_dir=tmp_path / "cache", val_fraction=0.1)
    assert bytes(data.tokens) == text.encode()
    assert data.vocab_size == 256 and data.val_start == len(text) - len(text) // 10
    x, y = next(TokenBatcher(data.train, seq_len=8, global_batch=2))
    assert x.shape == (2, 8) and y.dtype == torch.int64


def test_folder_input_is_recursive_and_sorted(tmp_path: Path) -> None:
    folder = tmp_path / "docs"
    (folder / "b").mkdir(parents=True)
    (folder / "b" / "z.txt").write_bytes(b"second ")
    (folder / "a.txt").write_bytes(b"first ")
    (folder / "c.md").write_bytes(b"third")
    data = load_tokens(folder, cache_dir=tmp_path / "cache")
    assert bytes(data.tokens.astype(np.uint8)) == b"first second third"
    assert data.tokens.dtype == np.uint16
    assert list((tmp_path / "cache").glob("dir-docs-*.u16.bin"))


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_token_file_input(tmp_path: Path, dtype: type) -> None:
    values = np.arange(5000, dtype=dtype) * 13 % 50_000
    suffix = ".u16.bin" if dtype == np.uint16 else ".u32.bin"
    values.tofile(tmp_path / f"train{suffix}")
    data = load_tokens(tmp_path / f"train{suffix}")
    assert data.tokens.dtype == dtype and np.array_equal(data.tokens, values)
    assert data.vocab_size is None
    values.tofile(tmp_path / "plain.bin")
    explicit = load_tokens(tmp_path / "plain.bin", token_dtype=np.dtype(dtype).name)
    assert np.array_equal(explicit.tokens, values)
    x, y = next(TokenBatcher(data.train, seq_len=32, global_batch=2))
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 50_000


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokens(tmp_path / "missing.txt")
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "ambiguous.bin")
    with pytest.raises(ValueError, match=r"\.u16\.bin or \.u32\.bin"):
        load_tokens(tmp_path / "ambiguous.bin")
    (tmp_path / "odd.u32.bin").write_bytes(b"\x00" * 6)
    with pytest.raises(ValueError, match="not a multiple of 4"):
        load_tokens(tmp_path / "odd.u32.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="contains no files"):
        load_tokens(tmp_path / "empty", cache_dir=tmp_path / "cache")
    tokens = _corpus(100)
    with pytest.raises(ValueError, match="fewer than seq_len \\+ 1 = 101"):
        TokenBatcher(tokens, seq_len=100, global_batch=2)
    with pytest.raises(ValueError, match="global_batch=6 is not divisible by world_size=4"):
        TokenBatcher(tokens, seq_len=8, global_batch=6, rank=0, world_size=4)
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        TokenBatcher(tokens, seq_len=8, global_batch=4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="holds 0 batches"):
        ValidationBatches(tokens, seq_len=30, global_batch=4)


def test_cache_dir_default_follows_the_environment(tmp_path: Path, monkeypatch) -> None:
    """The token cache's folder: FSDP_FLOAT8_CACHE_DIR, else $XDG_CACHE_HOME/fsdp_float8,
    else ~/.cache/fsdp_float8; the trainer's --cache-dir help names the one in effect."""
    monkeypatch.delenv("FSDP_FLOAT8_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_cache_dir() == Path.home() / ".cache" / "fsdp_float8"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "fsdp_float8"
    monkeypatch.setenv("FSDP_FLOAT8_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"
    small = tmp_path / "folder"
    small.mkdir()
    (small / "a.txt").write_text("hello " * 100)
    data = load_tokens(small)
    assert data.cache == next((tmp_path / "mine").glob("dir-folder-*.u16.bin"))
    assert load_tokens(small / "a.txt").cache is None  # a file is read in place


def test_folder_cache_follows_a_same_size_edit(tmp_path: Path, monkeypatch) -> None:
    """The cache of a folder is keyed by the files' contents: an edit that keeps the size
    and even the modification time trains on the new text; an unchanged folder is not read
    again (its files' stat records match the index next to the cache)."""
    folder, cache = tmp_path / "docs", tmp_path / "cache"
    folder.mkdir()
    text = folder / "a.txt"
    text.write_bytes(b"old text " * 50)
    first = load_tokens(folder, cache_dir=cache)
    assert bytes(first.tokens[:8].astype(np.uint8)) == b"old text"
    stat = text.stat()
    text.write_bytes(b"new text " * 50)  # same size
    os.utime(text, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the old mtime
    second = load_tokens(folder, cache_dir=cache)
    assert bytes(second.tokens[:8].astype(np.uint8)) == b"new text"
    assert second.cache != first.cache

    hashed: list[Path] = []
    real = token_cache._file_digest
    monkeypatch.setattr(token_cache, "_file_digest", lambda p, *a: hashed.append(p) or real(p, *a))
    third = load_tokens(folder, cache_dir=cache)
    assert hashed == [] and third.cache == second.cache  # stat only, no second read


def test_folder_file_with_a_non_utf8_name_trains(tmp_path: Path) -> None:
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"first ")
    with open(os.fsencode(folder) + b"/b\xff.txt", "wb") as f:
        f.write(b"second")
    data = load_tokens(folder, cache_dir=tmp_path / "cache")
    assert bytes(data.tokens.astype(np.uint8)) == b"first second"


def test_folder_binary_file_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    """A large file of NUL bytes in a folder (sparse: no disk) is refused, naming it, after
    reading one chunk of it: memory stays far below its size."""
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"text " * 100)
    big = folder / "big.bin"
    with open(big, "wb") as f:
        f.truncate(256 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="holds NUL bytes") as err:
            load_tokens(folder, cache_dir=tmp_path / "cache")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(big) in str(err.value)
    assert peak < 64 << 20, peak


def test_folder_cache_checks_the_free_space_before_reading(tmp_path: Path, monkeypatch) -> None:
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"text " * 1000)
    monkeypatch.setattr(token_cache, "_free_bytes", lambda path: 1000)
    monkeypatch.setattr(
        token_cache, "_file_digest", lambda *a: pytest.fail("read before the check")
    )
    with pytest.raises(ValueError, match="token cache") as err:
        load_tokens(folder, cache_dir=tmp_path / "cache")
    assert "5,000 bytes of text" in str(err.value) and "--cache-dir" in str(err.value), err.value
