"""The interface every place checkpoints can live behind: a local folder, or an object store.

A save always writes into a local staging folder first (the Accelerator's save hooks, ``torch.save``,
safetensors and DCP all write local files); the storage decides how that folder becomes a committed
checkpoint (an atomic rename on a local disk, an upload with the manifest last on an object store) and
how a committed checkpoint is found, checked, read back and rotated.

A location is a ``Path`` for local folders and a URL string (``s3://bucket/run/checkpoints/checkpoint_3``)
for object stores; every method takes either. What the rest of lockstep needs to know about a location it
asks its storage (:attr:`CheckpointStorage.local`, :meth:`CheckpointStorage.location`, ...): nothing outside
this folder looks at a URL's scheme.
"""

from __future__ import annotations

import abc
import contextlib
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

Location = str | os.PathLike
"""A checkpoint's folder: a local path, or a URL."""


class CheckpointStorage(abc.ABC):
    """Where checkpoints are committed, found, read and rotated."""

    node_local: bool = True
    """Whether every process of a machine sees the same staging folder (False: each process stages in a
    private temporary folder and uploads its own files)."""

    local: bool = False
    """Whether locations are folders of this machine's file system, written and read in place (``Path``
    objects): nothing to check before training. False: every process checks, before training, that it can
    reach and write the storage (:meth:`probe`)."""

    def location(self, text: Location) -> Location:
        """``text`` spelled as this storage's locations are: the URL string (a local storage: a ``Path``)."""
        return os.fspath(text)

    @abc.abstractmethod
    def join(self, root: Location, name: str) -> Location:
        """``root/name``."""

    @abc.abstractmethod
    def name(self, location: Location) -> str:
        """The last part of ``location`` (``checkpoint_3``)."""

    @abc.abstractmethod
    def parent(self, location: Location) -> Location:
        """The folder holding ``location``."""

    @abc.abstractmethod
    def children(self, root: Location) -> list[Location]:
        """The folders directly under ``root`` (none when it does not exist)."""

    @abc.abstractmethod
    def exists(self, location: Location) -> bool:
        """Whether a file or folder is at ``location``."""

    @abc.abstractmethod
    def remove(self, location: Location) -> None:
        """Delete the folder ``location`` (a checkpoint stops counting before any of its files goes)."""

    @abc.abstractmethod
    def probe(self) -> None:
        """Check that the storage is reachable and writable (raises a clear error)."""

    @abc.abstractmethod
    def prepare(self, final: Location, *, main: bool) -> Path:
        """The local staging folder this process writes ``final``'s files into (emptied by ``main``)."""

    def discard(self, staging: Path, *, main: bool) -> None:
        """Remove what a failed save staged here (``main``: the process that prepared ``staging``)."""
        if main:
            shutil.rmtree(staging, ignore_errors=True)

    @abc.abstractmethod
    def rank_writer(
        self,
        write: Callable[[], None],
        staging: Path,
        final: Location,
        rank: int,
        *,
        background: bool,
        written: Mapping[str, dict[str, Any]] | None = None,
    ) -> Callable[[], None]:
        """``write`` (this rank's files into ``staging``) plus whatever makes them reach ``final`` and tells
        the committing process that this rank is done. ``written`` is filled by ``write`` with the manifest
        entries of its files, computed as they were written: the manifest records those."""

    @abc.abstractmethod
    def commit(
        self,
        staging: Path,
        final: Location,
        *,
        world_size: int,
        step: int,
        move_latest_pointer: bool,
        wait_seconds: float | None,
        known: Mapping[str, dict[str, Any]] | None = None,
    ) -> None:
        """Write the manifest last and make ``final`` a committed, durable checkpoint (the committing process).

        Args:
            wait_seconds: how long to wait for the other ranks' files (None: they are known to be done).
            known: every rank's manifest entries computed as its files were written, by file name.
        """

    def commit_deferring_fsync(
        self,
        staging: Path,
        final: Location,
        *,
        world_size: int,
        step: int,
        move_latest_pointer: bool,
        known: Mapping[str, dict[str, Any]],
    ) -> Callable[[], None] | None:
        """Make ``final`` the committed checkpoint now, manifest last, ``latest`` moved, without waiting for
        the disk; returns what makes it durable (fsync), which changes nothing visible and runs on a thread
        (a ``durable="background"`` save), or None when it is durable already. This default commits
        durably (an object store's upload is durable when it returns)."""
        self.commit(
            staging,
            final,
            world_size=world_size,
            step=step,
            move_latest_pointer=move_latest_pointer,
            wait_seconds=None,
            known=known,
        )
        return None

    @abc.abstractmethod
    def check(self, folder: Location, *, accelerate_layout: bool = True) -> None:
        """Raise a ``CheckpointError`` unless ``folder`` is a committed checkpoint (or, with
        ``accelerate_layout``, one Accelerate's ``save_state`` wrote, which has no manifest)."""

    @abc.abstractmethod
    def newest_valid(self, root: Location, *, before: int | None = None) -> Location:
        """The newest ``checkpoint_{i}`` under ``root`` that :meth:`check` accepts (only ``i < before`` when
        given); warns about newer broken ones. Raises ``FileNotFoundError`` when there is none."""

    @abc.abstractmethod
    def rotate(
        self, root: Location, total_limit: int | None, *, within_seconds: float | None = None
    ) -> list[Location]:
        """Delete the oldest ``checkpoint_{i}`` beyond ``total_limit``; returns what was deleted. Each stops
        counting at once; ``within_seconds`` bounds the time spent deleting (the rest may be left to
        :meth:`commit_deferring_fsync`'s durability work)."""

    @abc.abstractmethod
    def readable(self, folder: Location) -> contextlib.AbstractContextManager[Path]:
        """A context giving a local folder with ``folder``'s files, checksums verified."""

    @abc.abstractmethod
    def writable(
        self, folder: Location, *, upload: bool = True, fetch: tuple[str, ...] = ()
    ) -> contextlib.AbstractContextManager[Path]:
        """A context giving a local folder standing for ``folder``, for files that are not checkpoints (the
        Trainer's final model, metrics, model card): what is written there is in ``folder`` once the block
        ends without an error.

        Args:
            upload: whether this process puts what it wrote into ``folder`` (the process that writes).
            fetch: files of ``folder`` to find in the local folder first, where they exist (to be updated).
        """


@contextlib.contextmanager
def as_local(path: Path) -> Iterator[Path]:
    """The folder itself: a local checkpoint needs no copy."""
    yield path
