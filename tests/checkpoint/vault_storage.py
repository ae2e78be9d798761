"""A checkpoint storage written outside lockstep, for the registry's tests: ``vault://<path>`` locations
kept under a local folder (``VaultStorage.root``), each call recorded in ``VaultStorage.calls``.

It is what a user's storage looks like: a ``CheckpointStorage`` subclass built as
``VaultStorage(location, storage_options)``, registered with ``register_storage("vault", VaultStorage)`` or
as the entry point ``vault = "tests.checkpoint.vault_storage:VaultStorage"`` of the ``lockstep.storages``
group. Its locations stay URLs (it is not ``local``), so lockstep reaches the files only through it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from lockstep.checkpoint.storage import CheckpointStorage, LocalStorage, Location

SCHEME = "vault://"


class VaultStorage(CheckpointStorage):
    """``vault://a/b`` is the folder ``root/a/b``, reached through a ``LocalStorage``."""

    root: ClassVar[Path | None] = None
    calls: ClassVar[list[str]] = []
    node_local = True
    local = False

    def __init__(self, location: str, storage_options: dict[str, Any] | None = None) -> None:
        if self.root is None:
            raise RuntimeError("Set VaultStorage.root before using vault:// locations.")
        self.options = storage_options
        self.files = LocalStorage()

    def _path(self, location: Location) -> Path:
        text = os.fspath(location)
        if not text.startswith(SCHEME):
            raise ValueError(f"{text!r} is not a vault:// location.")
        assert self.root is not None
        return self.root / text.removeprefix(SCHEME)

    def _url(self, path: Location) -> str:
        assert self.root is not None
        return SCHEME + Path(path).relative_to(self.root).as_posix()

    def join(self, root: Location, name: str) -> str:
        return f"{os.fspath(root).rstrip('/')}/{name}"

    def name(self, location: Location) -> str:
        return self._path(location).name

    def parent(self, location: Location) -> str:
        return self._url(self._path(location).parent)

    def children(self, root: Location) -> list[Location]:
        return [self._url(p) for p in self.files.children(self._path(root))]

    def exists(self, location: Location) -> bool:
        return self.files.exists(self._path(location))

    def remove(self, location: Location) -> None:
        self.files.remove(self._path(location))

    def probe(self) -> None:
        self.calls.append("probe")

    def prepare(self, final: Location, *, main: bool) -> Path:
        return self.files.prepare(self._path(final), main=main)

    def discard(self, staging: Path, *, main: bool) -> None:
        self.files.discard(staging, main=main)

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
        return self.files.rank_writer(
            write, staging, self._path(final), rank, background=background, written=written
        )

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
        self.calls.append(f"commit {final}")
        self.files.commit(
            staging,
            self._path(final),
            world_size=world_size,
            step=step,
            move_latest_pointer=move_latest_pointer,
            wait_seconds=wait_seconds,
            known=known,
        )

    def check(self, folder: Location, *, accelerate_layout: bool = True) -> None:
        self.files.check(self._path(folder), accelerate_layout=accelerate_layout)

    def newest_valid(self, root: Location, *, before: int | None = None) -> str:
        return self._url(self.files.newest_valid(self._path(root), before=before))

    def rotate(
        self, root: Location, total_limit: int | None, *, within_seconds: float | None = None
    ) -> list[Location]:
        gone = self.files.rotate(self._path(root), total_limit, within_seconds=within_seconds)
        return [self._url(p) for p in gone]

    def readable(self, folder: Location) -> contextlib.AbstractContextManager[Path]:
        self.calls.append(f"read {folder}")
        return self.files.readable(self._path(folder))

    def writable(
        self, folder: Location, *, upload: bool = True, fetch: tuple[str, ...] = ()
    ) -> contextlib.AbstractContextManager[Path]:
        return self.files.writable(self._path(folder), upload=upload, fetch=fetch)
