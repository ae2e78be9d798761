"""Reading a sharded (DCP) checkpoint straight from object storage: each process reads only the parts of
shard files its own plan needs, with torch's ``FsspecReader``.

The metadata is unpickled with :mod:`lockstep.checkpoint.safe_dcp`'s allow-list; the shard files' sizes were
checked against the manifest before, and their checksums are verified by the processes loading, each its
share of the files (see :class:`SafeFsspecReader`). Imported only for URLs; ``FsspecReader`` is private in
torch 2.13 (``torch.distributed.checkpoint._fsspec_filesystem``), so importing this module raises
``ImportError`` where neither place has it, and the caller downloads the whole checkpoint instead.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from lockstep.checkpoint.dcp_metadata import METADATA_FILE, RemoteFolder, SafeMetadataReading
from lockstep.checkpoint.layout import CHECKSUMS
from lockstep.errors import CheckpointError

try:
    FsspecReader: Any = dcp.FsspecReader  # type: ignore[attr-defined]
except AttributeError:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

BLOCK_BYTES = 1 << 20
"""Block size of the shard files read in place (values of other ranks' files)."""


def _natural(name: str) -> list[Any]:
    """Sort key: ``__2_0.distcp`` before ``__10_0.distcp``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


class _LocalFirst:
    """torch's fsspec ``FileSystem`` for a reader, serving the files already downloaded from local copies."""

    def __init__(self, remote: Any, local: dict[str, Path]) -> None:
        self.remote, self.local = remote, local

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str | os.PathLike[str]:
        return self.remote.concat_path(path, suffix)

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        local = self.local.get(os.fspath(path))
        if local is not None:
            with open(local, mode) as stream:
                yield stream
            return
        # Blocks kept once fetched: DCP reads small values out of offset order, which the default
        # read-ahead cache answers by fetching the rest of the file again each time.
        with self.remote.fs.open(
            os.fspath(path), mode, cache_type="blockcache", block_size=BLOCK_BYTES
        ) as stream:
            yield stream


class SafeFsspecReader(SafeMetadataReading, FsspecReader):
    """torch's ``FsspecReader`` on ``remote.url``, through lockstep's file system (its timeouts and
    credentials), with allow-listed metadata.

    Before its first read, each process downloads its ``part`` of the shard files (rank ``r`` of ``w``: files
    ``r``, ``r + w``, ... in rank order; with an unchanged world size, its own), verifies their checksums
    and reads them locally; the rest it reads in place, only the bytes its plan needs. So every shard file is
    verified by one process, and each process fetches about 1/w of the checkpoint plus what it needs of the
    others' files (DCP stores a value every rank holds, such as an optimizer's ``step``, in one rank's file).

    Args:
        remote: where the shard files are, and their manifest entries.
        part: (rank, world size) of this process among those loading; None: verify none (sizes only).
    """

    def __init__(self, remote: RemoteFolder, part: tuple[int, int] | None) -> None:
        super().__init__(remote.url)
        self.fs.fs = remote.filesystem
        # The metadata was downloaded and verified with the checkpoint's other small files: read that copy
        metadata = {str(self.fs.concat_path(self.path, METADATA_FILE)): remote.local / METADATA_FILE}
        self.fs = _LocalFirst(self.fs, metadata)
        self.remote = remote
        self.part = part

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self.part is None:
            return super().read_data(plan, planner)
        rank, world_size = self.part
        names = sorted(self.remote.files, key=_natural)[rank::world_size]
        remote_fs = self.fs
        with tempfile.TemporaryDirectory(prefix="lockstep-shards-") as temporary:
            local = {str(self.fs.concat_path(self.path, name)): Path(temporary) / name for name in names}
            if local:
                self.remote.filesystem.get(list(local), [str(path) for path in local.values()])
            for name, path in zip(names, local.values()):
                self._verify(name, path)
            self.fs = _LocalFirst(remote_fs.remote, {**remote_fs.local, **local})
            try:  # torch's read_data is synchronous: the local copies are read before they go
                return super().read_data(plan, planner)
            finally:
                self.fs = remote_fs

    def _verify(self, name: str, path: Path) -> None:
        facts = self.remote.files[name]
        where = f"{self.remote.url}/{name}"
        kind = next((kind for kind in CHECKSUMS if kind in facts), None)
        if kind is None:
            raise CheckpointError(
                f"The manifest entry of {where} records no checksum lockstep knows (it has {sorted(facts)}; "
                f"known: {sorted(CHECKSUMS)}). Load it with the lockstep version that wrote it."
            )
        if path.stat().st_size != facts["size"] or CHECKSUMS[kind](path) != facts[kind]:
            raise CheckpointError(
                f"Checkpoint shard {where} is corrupt (its size or {kind} checksum does not match the manifest)."
            )
