"""Reading ``torch.distributed.checkpoint`` (DCP) folders without running pickled code.

torch's ``FileSystemReader`` unpickles a DCP folder's ``.metadata`` with plain :mod:`pickle`, and its
``DefaultLoadPlanner`` reads every non-tensor value (an optimizer's ``param_groups``, say) with
``torch.load(weights_only=False)``: a folder from elsewhere could run code while it loads. Here the
metadata is unpickled with an allow-list (DCP's own metadata classes, dtypes, sizes and paths:
:mod:`lockstep.checkpoint.dcp_metadata`) and every non-tensor value must load with ``weights_only=True``
first; tensors are already read that way by torch.
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
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from lockstep.checkpoint.dcp_metadata import RemoteFolder, SafeMetadataReading, read_metadata
from lockstep.errors import CheckpointError, UnsafeCheckpointError


class SafeFileSystemReader(SafeMetadataReading, dcp.FileSystemReader):
    """torch's ``FileSystemReader`` with the allow-listed unpickling of :func:`read_metadata`."""


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
