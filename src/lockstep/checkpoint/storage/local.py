"""Checkpoints in a local (or shared, POSIX) folder.

Staging folder next to the destination, manifest written last, one atomic ``os.replace``, then the
``latest`` pointer (see :mod:`lockstep.checkpoint.layout`); every fsync before the manifest, or all of them
after the commit on a thread (:meth:`LocalStorage.commit_deferring_fsync`). ``file://`` URLs land here too: they are
local folders, where the atomic rename is the stronger guarantee.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from lockstep.checkpoint import layout
from lockstep.checkpoint.async_writer import rank_work, wait_for_ranks
from lockstep.checkpoint.storage.base import CheckpointStorage, Location, as_local


def _path(location: Location) -> Path:
    text = str(location)
    return Path(text.removeprefix("file://")) if text.startswith("file://") else Path(location)


class LocalStorage(CheckpointStorage):
    """Checkpoints in folders of the local file system (which may be a shared one: NFS, Lustre, ...)."""

    node_local = True
    local = True

    def location(self, text: Location) -> Path:
        return _path(text)

    def join(self, root: Location, name: str) -> Path:
        return _path(root) / name

    def name(self, location: Location) -> str:
        return _path(location).name

    def parent(self, location: Location) -> Path:
        return _path(location).parent

    def children(self, root: Location) -> list[Location]:
        root = _path(root)
        return [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []

    def exists(self, location: Location) -> bool:
        return _path(location).exists()

    def remove(self, location: Location) -> None:
        shutil.rmtree(_path(location), ignore_errors=True)

    def probe(self) -> None:
        """Nothing to check: a missing or read-only folder fails the save with the OS's own error."""

    def prepare(self, final: Location, *, main: bool) -> Path:
        final = _path(final)
        return layout.prepare_staging(final) if main else layout.staging_dir_for(final)

    def discard(self, staging: Path, *, main: bool) -> None:
        if main:
            shutil.rmtree(staging, ignore_errors=True)
            with contextlib.suppress(OSError):  # another save may still be in progress there
                staging.parent.rmdir()

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
        # Synchronous saves agree through a collective (which carries `written`); background ones through
        # marker files (which carry it).
        return rank_work(write, staging, rank, written) if background else write

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
        known = dict(known or {})
        if wait_seconds is not None:
            known.update(wait_for_ranks(staging, world_size, timeout=wait_seconds))
        layout.write_manifest(staging, world_size=world_size, step=step, known=known)
        layout.commit(staging, _path(final), move_latest_pointer=move_latest_pointer)

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
        final = _path(final)
        manifest = layout.write_manifest(staging, world_size=world_size, step=step, known=known, fsync=False)
        layout.commit(staging, final, move_latest_pointer=move_latest_pointer, durable=False)
        names = [*manifest.files, layout.MANIFEST_NAME]

        def make_durable() -> None:
            layout.make_durable(final, names)
            layout.remove_renamed_away(final.parent)  # what a slow rotation left

        return make_durable

    def check(self, folder: Location, *, accelerate_layout: bool = True, checksums: bool = True) -> None:
        if not (accelerate_layout and layout.written_by_accelerate(_path(folder))):
            layout.verify(_path(folder), checksums=checksums)

    def newest_valid(self, root: Location, *, checksums: bool = True, before: int | None = None) -> Path:
        return layout.newest_valid_checkpoint(_path(root), checksums=checksums, before=before)

    def rotate(
        self, root: Location, total_limit: int | None, *, within_seconds: float | None = None
    ) -> list[Location]:
        return list(layout.rotate(_path(root), total_limit, within_seconds=within_seconds))

    def readable(self, folder: Location) -> contextlib.AbstractContextManager[Path]:
        return as_local(_path(folder))

    @contextlib.contextmanager
    def writable(
        self, folder: Location, *, upload: bool = True, fetch: tuple[str, ...] = ()
    ) -> Iterator[Path]:
        """The folder itself: its files are written in place."""
        yield _path(folder)
