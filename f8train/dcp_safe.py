"""Loading a DCP checkpoint without running code from its files.

DCP keeps its metadata (``.metadata``) and the non-tensor items of a state dict as pickles,
and unpickling a pickle can call any function it names. ``SafeFileSystemReader`` reads the
metadata with an unpickler that builds only the classes DCP's metadata is made of
(``METADATA_GLOBALS``) and refuses any other name; ``WeightsOnlyLoadPlanner`` loads the
non-tensor items ``weights_only``. The tensors are read by DCP's ``FileSystemReader``, which
loads each with ``torch.load(weights_only=True)``. A refusal is a ``ValueError`` that names
what was refused and the checkpoint.
"""

from __future__ import annotations

import collections
import io
import os
import pathlib
import pickle
from typing import IO, Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_METADATA_CLASSES = (
    "Metadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "_MEM_FORMAT_ENCODING",
)
_PATHS = ("PurePath", "PurePosixPath", "PureWindowsPath", "Path", "PosixPath", "WindowsPath")

# What ``.metadata`` may name, ``(module, name)``: DCP's metadata classes, its file
# system's per-item storage record, tensor sizes, dtypes and layouts (a tensor item's
# properties), the checkpoint's path (``StorageMeta.checkpoint_id``) and ordered dicts.
METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **{(dcp_metadata.__name__, n): getattr(dcp_metadata, n) for n in _METADATA_CLASSES},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    **{("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)},
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    **{("pathlib", n): getattr(pathlib, n) for n in _PATHS},
    ("collections", "OrderedDict"): collections.OrderedDict,
}

_REMEDY = (
    "f8train's checkpoints hold only DCP's metadata classes, tensor sizes, dtypes and "
    "paths there, so this folder was written by other code (or by a torch version whose "
    "DCP metadata holds more) or altered. Resume from another checkpoint (--resume CKPT), "
    "or start a new run with another --out"
)


class _Refused(ValueError):
    """A global outside ``METADATA_GLOBALS``."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what ``METADATA_GLOBALS`` holds; imports nothing."""

    def __init__(self, file: IO[bytes], source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        found = METADATA_GLOBALS.get((module, name))
        if found is None:
            raise _Refused(
                f"{self.source} names {module}.{name}, which is not one of the classes DCP's "
                "metadata is made of (a pickle may call whatever it names), so the file was "
                f"not unpickled: {_REMEDY}"
            )
        return found


def load_metadata(file: IO[bytes], source: str) -> Metadata:
    """Unpickle DCP's ``Metadata`` from ``file`` (``source``: its path, for messages)."""
    try:
        metadata = _MetadataUnpickler(file, source).load()
    except _Refused:
        raise
    except Exception as err:  # anything else a damaged or foreign pickle raises
        raise ValueError(
            f"{source} is not DCP metadata ({type(err).__name__}: {err}): {_REMEDY}"
        ) from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{source} holds a {type(metadata).__name__}, not DCP metadata: {_REMEDY}")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader``, reading ``.metadata`` with ``load_metadata``. Only the
    global ``.metadata`` is read (f8train's saves write one): DCP's fallback to per-rank
    metadata files, tried when it cannot be read, is refused."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if (rank := kwargs.get("rank")) is not None:
            raise ValueError(f"{self._get_metadata_path(rank)}: per-rank metadata is not read")
        path = self._get_metadata_path()
        with self.fs.create_stream(path, "rb") as file:
            metadata = load_metadata(file, os.fspath(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load, but the non-tensor items (the optimizer's hyperparameters, the
    scheduler's and the batcher's counters) unpickle ``weights_only``: DCP's own planner
    unpickles them with ``weights_only=False``, which runs whatever code a file holds."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            item = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            lines = [line.strip() for line in str(err).splitlines()]
            why = next((line for line in lines if "Unsupported global" in line), lines[0])
            why = why.removeprefix("WeightsUnpickler error: ").split(" was not an allowed")[0]
            raise ValueError(
                f"the checkpoint item {fqn!r} is not plain data ({why}): f8train's "
                "checkpoints hold tensors, numbers, strings and containers of them, so this "
                "folder was written by other code or altered; resume from another checkpoint"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], item)
        else:
            self.state_dict[fqn] = item
