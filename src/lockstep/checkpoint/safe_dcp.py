"""Reading ``torch.distributed.checkpoint`` (DCP) folders without running pickled code.

torch's ``FileSystemReader`` unpickles a DCP folder's ``.metadata`` with plain :mod:`pickle`, and its
``DefaultLoadPlanner`` reads every non-tensor value (an optimizer's ``param_groups``, say) with
``torch.load(weights_only=False)``: a folder from elsewhere could run code while it loads. Here the
metadata is unpickled with an allow-list (DCP's own metadata classes, dtypes, sizes and paths) and every
non-tensor value must load with ``weights_only=True`` first; tensors are already read that way by torch.
Anything else raises :class:`~lockstep.errors.UnsafeCheckpointError` before it is run.

Example:
    >>> from lockstep.checkpoint.safe_dcp import check_folder
    >>> check_folder("ckpt/pytorch_model_fsdp_0")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from lockstep.errors import CheckpointError, UnsafeCheckpointError

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


class SafeFileSystemReader(SafeMetadataReading, dcp.FileSystemReader):
    """torch's ``FileSystemReader`` with the allow-listed unpickling of :func:`read_metadata`."""


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


_REMOTE: dict[Path, RemoteFolder] = {}
"""Local DCP folders (in this process) whose shard files are read from object storage instead."""


@contextlib.contextmanager
def remote_shards(folders: dict[Path, RemoteFolder]) -> Iterator[None]:
    """While inside, loading the local DCP folders of ``folders`` reads their shards from the URLs given."""
    _REMOTE.update(folders)
    try:
        yield
    finally:
        for folder in folders:
            _REMOTE.pop(folder, None)


def _reader(folder: str | os.PathLike[str], part: tuple[int, int] | None) -> dcp.StorageReader:
    """The reader of ``folder``: local, or on object storage (see :func:`remote_shards`), where this process
    verifies the checksums of its ``part`` (rank, world size) of the shard files; None: none of them."""
    remote = _REMOTE.get(Path(folder))
    if remote is None:
        return SafeFileSystemReader(str(folder))
    from lockstep.checkpoint.storage.dcp_reader import SafeFsspecReader

    return SafeFsspecReader(remote, part)


def _reason(error: pickle.UnpicklingError) -> str:
    """The sentence of torch's weights_only error that names what was refused."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if "GLOBAL" in line or "WeightsUnpickler error" in line:
            sentence = line.removeprefix("WeightsUnpickler error: ")
            return sentence.split(". ")[0].rstrip(".")
    return lines[0] if lines else type(error).__name__


def _checked_load(value: io.BytesIO, where: str) -> Any:
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(
            f"{where} holds Python objects that cannot be loaded safely, so it was refused without running "
            f"them ({_reason(error)}). Load only checkpoints from a source you trust."
        ) from None


@contextlib.contextmanager
def _refusals_raised() -> Iterator[None]:
    """Raise a refusal (or a shard failing its checksum) inside ``torch.distributed.checkpoint`` as itself,
    not wrapped in its ``CheckpointException`` (a ``BaseException`` that lists every rank's traceback)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as error:
        for failure in error.failures.values():
            if isinstance(failure[0], (UnsafeCheckpointError, CheckpointError)):
                raise failure[0] from None
        raise


@contextlib.contextmanager
def _in_one_process() -> Iterator[None]:
    with warnings.catch_warnings():
        # Reading in this one process (no_dist=True) is the intent; torch warns about it on every call.
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner``, whose non-tensor values must load with ``weights_only=True``.

    Args:
        folder: the folder read (named in errors).
        **kwargs: ``DefaultLoadPlanner``'s arguments.
    """

    def __init__(self, folder: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.folder = folder

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _checked_load(value, f"{self.folder}: the value {read_item.dest_index.fqn!r}")
        # Accepted by the restricted unpickler: torch's planner now rebuilds the same objects (and puts
        # them where its flattening of nested dicts says).
        value.seek(0)
        super().load_bytes(read_item, value)


def load(state: dict[str, Any], folder: str | os.PathLike[str], *, no_dist: bool = False) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` from ``folder``, safely: a collective, or a read in
    this one process with ``no_dist``.

    Raises:
        UnsafeCheckpointError: the folder carries arbitrary Python objects (they are not run).
    """
    together = not no_dist and torch.distributed.is_available() and torch.distributed.is_initialized()
    part = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if together else (0, 1)
    with _refusals_raised(), _in_one_process() if no_dist else contextlib.nullcontext():
        dcp.load(
            state,
            storage_reader=_reader(folder, part),
            planner=SafeLoadPlanner(folder),
            no_dist=no_dist,
        )


def check_folder(folder: str | os.PathLike[str]) -> dcp_metadata.Metadata:
    """Check, in this one process, that ``folder``'s metadata and non-tensor values load safely.

    Meant for the main process before a collective load, so that a refused folder is an error that every
    process can agree on rather than a failure inside ``torch.distributed.checkpoint``.

    Returns:
        The folder's metadata.

    Raises:
        FileNotFoundError: the folder has no metadata file.
        UnsafeCheckpointError: the metadata or a non-tensor value carries arbitrary Python objects.
    """
    metadata = read_metadata(folder)
    values: dict[str, Any] = {
        key: None
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, dcp_metadata.BytesStorageMetadata)
    }
    if values:
        # Unflattened keys: only these values are read, each through SafeLoadPlanner.load_bytes.
        with _refusals_raised(), _in_one_process():
            dcp.load(
                values,
                # Only non-tensor values are read here; the shard files' checksums are verified by the load
                storage_reader=_reader(folder, None),
                planner=SafeLoadPlanner(folder, flatten_state_dict=False),
                no_dist=True,
            )
    return metadata
