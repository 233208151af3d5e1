"""Nothing read from a checkpoint runs code: DCP's files are unpickled only as far as data goes.

DCP reads tensors with `torch.load(weights_only=True)`; `WeightsOnlyLoadPlanner` reads its
non-tensor entries (optimizer hyperparameters) the same way, where DCP's default would unpickle
them freely; and DCP's own `.metadata` index, a pickle by DCP's design, is read by
`read_metadata`, which builds DCP's metadata types and the torch and pathlib values they hold,
and refuses anything else unread (CheckpointError naming it). `MetadataReader` is DCP's file
reader with that `.metadata` read: every load in raymesh.train.checkpoint goes through it.
"""

from __future__ import annotations

import io
import pickle
from pathlib import PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from raymesh.train.checkpoint.errors import CheckpointError

__all__ = ["MetadataReader", "WeightsOnlyLoadPlanner", "data_files", "read_metadata"]


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor entries are read with weights_only=True (the
    default unpickles them with weights_only=False, which can run arbitrary code)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` and nothing else: a global is found only if it is one of
    DCP's metadata types or a value they hold (a torch dtype, `torch.Size`, a layout, a path).
    Anything else (a function to call, a class whose construction has effects) is refused
    before it is looked up, so no `.metadata`, however it was written, can run code; the
    objects it can build only hold data."""

    _ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",  # an Enum: how TensorProperties pickles a memory format
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},  # a layout by name, from torch's own table
        "torch": {"Size"},  # and the dtypes, checked by type below
        "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
        "collections": {"OrderedDict"},
    }

    def __init__(self, file: Any, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in self._ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self.where} refers to {module}.{name}, which is not one of DCP's metadata "
            "types: refused unread (this file was not written by torch.distributed.checkpoint, "
            "or was altered after)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.where} holds a persistent reference: not DCP metadata")


def read_metadata(file: Any, where: str) -> Metadata:
    """DCP's Metadata from an open `.metadata` file, by `_MetadataUnpickler` (CheckpointError
    for anything else in it, and for a file that is not a pickle)."""
    try:
        metadata = _MetadataUnpickler(file, where).load()
    except CheckpointError:
        raise
    except Exception as e:  # truncated or not a pickle: what pickle raises varies
        raise CheckpointError(f"{where} is not DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{where} holds a {type(metadata).__name__}, not DCP's Metadata")
    data_files(metadata, where)
    return metadata


def data_files(metadata: Metadata, where: str = ".metadata") -> set[str]:
    """The files, relative to the checkpoint's folder, that `metadata` sends DCP's reads to.
    CheckpointError for one that is not a plain relative path inside the folder (absolute,
    `..`, a drive, empty): DCP would read it, outside the checkpoint, as a tensor's bytes."""
    found: set[str] = set()
    storage = getattr(metadata, "storage_data", None) or {}
    if not isinstance(storage, dict):
        raise CheckpointError(f"{where}: storage_data is a {type(storage).__name__}, not a dict")
    for info in storage.values():
        rel: Any = getattr(info, "relative_path", None)
        plain = isinstance(rel, str) and rel and "\\" not in rel and ":" not in rel
        path = PurePosixPath(rel if plain else "/")
        if not plain or path.is_absolute() or ".." in path.parts:
            raise CheckpointError(
                f"{where} sends a read to {rel!r}, which is not a file inside the checkpoint's "
                "folder: refused (DCP writes plain file names there)"
            )
        found.add(rel)
    return found


class MetadataReader(FileSystemReader):
    """DCP's FileSystemReader, but `.metadata` is read by `read_metadata` (DCP's own reader
    unpickles it with `pickle.load`, which runs whatever the file says). The rest of what DCP's
    `read_metadata` does is repeated as it is."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path: Any
        if hasattr(self, "_get_metadata_path"):  # torch >= 2.6 (rank-specific metadata)
            path = self._get_metadata_path(rank)
        else:
            path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as file:
            metadata = read_metadata(file, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return metadata
