"""A DCP folder's metadata, read without running pickled code, and where a folder's shards are when they
stay on object storage.

torch's ``FileSystemReader`` unpickles a DCP folder's ``.metadata`` with plain :mod:`pickle`; here it is
unpickled with an allow-list (DCP's own metadata classes, dtypes, sizes and paths), and anything else raises
:class:`~lockstep.errors.UnsafeCheckpointError` before it is run. Below both readers of DCP folders: the local
one (:mod:`lockstep.checkpoint.safe_dcp`) and the one reading from object storage
(:mod:`lockstep.checkpoint.storage.dcp_reader`).
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata

from lockstep.errors import UnsafeCheckpointError

METADATA_FILE = ".metadata"

# What a DCP .metadata pickle refers to besides DCP's metadata classes (measured with torch 2.13).
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    *(
        (module, name)
        for module in ("pathlib", "pathlib._local")
        for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
    ),
}


def _is_allowed(module: str, name: str) -> bool:
    if (module, name) in _ALLOWED_GLOBALS:
        return True
    if module == "torch":  # torch.float32, torch.bfloat16, ...
        return isinstance(getattr(torch, name, None), torch.dtype)
    if module == dcp_metadata.__name__:  # Metadata, TensorStorageMetadata, ChunkStorageMetadata, ...
        value = getattr(dcp_metadata, name, None)
        return isinstance(value, type) and value.__module__ == module
    return False


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, stream: BinaryIO, path: str | os.PathLike[str]) -> None:
        super().__init__(stream)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if not _is_allowed(module, name):
            raise UnsafeCheckpointError(
                f"{self.path} refers to {module}.{name}, which is not part of a DCP checkpoint's metadata, so it "
                "was refused without running it. Load only checkpoints from a source you trust, or re-save this "
                "one with torch.distributed.checkpoint.save."
            )
        return super().find_class(module, name)


def _unpickle_metadata(stream: BinaryIO, path: str | os.PathLike[str]) -> dcp_metadata.Metadata:
    metadata = _MetadataUnpickler(stream, path).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeCheckpointError(
            f"{path} holds a {type(metadata).__name__}, not DCP metadata; it was not written by "
            "torch.distributed.checkpoint."
        )
    return metadata


def read_metadata(folder: str | os.PathLike[str], rank: int | None = None) -> dcp_metadata.Metadata:
    """A DCP folder's metadata, unpickled with the allow-list.

    Args:
        folder: the DCP folder.
        rank: read the rank-local metadata file ``__{rank}.metadata`` instead of the global one.

    Raises:
        FileNotFoundError: the folder has no metadata file.
        UnsafeCheckpointError: the metadata refers to anything but DCP's metadata classes.
    """
    path = Path(folder) / (METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")
    with open(path, "rb") as stream:
        return _unpickle_metadata(stream, path)


class SafeMetadataReading:
    """Mixin for torch's ``FileSystemReader`` and its subclasses (``FsspecReader``): the metadata is read
    through the reader's own file system, unpickled with the allow-list instead of plain :mod:`pickle`."""

    fs: Any
    load_id: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        # _get_metadata_path: torch's FileSystemReader's, which comes after this mixin in the class
        path = self._get_metadata_path(kwargs.get("rank"))  # type: ignore[attr-defined]
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _unpickle_metadata(stream, path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


@dataclass(frozen=True)
class RemoteFolder:
    """Where a DCP folder's shard files are, when only its metadata was downloaded (object storage)."""

    url: str
    filesystem: Any
    """The fsspec file system serving ``url``."""
    local: Path
    """The local folder holding its (downloaded, verified) metadata."""
    files: dict[str, dict[str, Any]]
    """Shard file name in the folder -> its manifest entry (size and checksum)."""
