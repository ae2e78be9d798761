"""Writing a checkpoint in the background while training continues.

Training stops only while each rank copies its state to CPU memory (the snapshot). A background thread
per rank then writes the files and drops a marker (``.rank_{r}.done``, with the manifest entries of its
files, or ``.rank_{r}.failed``) in the staging folder; the main process's thread waits for every rank's
marker, then writes the manifest and commits exactly as a synchronous save does. The background threads use files, not collectives, so they
never interleave with the training loop's collectives. The next save (or :meth:`AsyncCheckpointWriter.wait`)
waits for the previous one and raises its error, if any.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lockstep.errors import CheckpointError

MARKER_POLL_SECONDS = 0.05


def done_marker(staging: Path, rank: int) -> Path:
    return staging / f".rank_{rank}.done"


def failed_marker(staging: Path, rank: int) -> Path:
    return staging / f".rank_{rank}.failed"


def wait_for_ranks(staging: Path, world_size: int, timeout: float) -> dict[str, dict[str, Any]]:
    """Block until every rank dropped its marker; raise if one failed or the wait times out. Returns the
    manifest entries the ranks' markers carry (computed as their files were written), by file name."""
    deadline = time.monotonic() + timeout
    while True:
        failed = [r for r in range(world_size) if failed_marker(staging, r).exists()]
        if failed:
            text = (
                failed_marker(staging, failed[0]).read_text()
                or "(no details: its marker could not be written)"
            )
            kind = CheckpointError if text.startswith(f"{CheckpointError.__name__}: ") else RuntimeError
            raise kind(f"rank {failed[0]} could not write its part of the checkpoint: {text}")
        if all(done_marker(staging, r).exists() for r in range(world_size)):
            known: dict[str, dict[str, Any]] = {}
            for r in range(world_size):
                known.update(_written_by(done_marker(staging, r)))
                done_marker(staging, r).unlink()
            return known
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if not done_marker(staging, r).exists()]
            raise TimeoutError(f"ranks {missing} did not finish writing {staging} within {timeout:.0f} s")
        time.sleep(MARKER_POLL_SECONDS)


def settle(staging: Path, world_size: int, timeout: float) -> None:
    """Block until every rank dropped a marker, done or failed (at most ``timeout`` seconds): after a
    failure, the staging folder is removed only once no rank writes into it any more."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(
        done_marker(staging, r).exists() or failed_marker(staging, r).exists() for r in range(world_size)
    ):
        time.sleep(MARKER_POLL_SECONDS)


class AsyncCheckpointWriter:
    """One background save at a time, per process."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_write_seconds: float | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def failed(self) -> bool:
        """Whether the background save has ended with an error that :meth:`wait` has not raised yet."""
        return self._error is not None and not self.busy

    def start(self, work: Callable[[], None]) -> None:
        """Run ``work`` in the background (after waiting for the previous save)."""
        self.wait()

        def run() -> None:
            started = time.monotonic()
            try:
                work()
            except BaseException as error:  # reported to the training thread by wait()
                self._error = error
            self.last_write_seconds = time.monotonic() - started

        self._thread = threading.Thread(target=run, name=WRITER_THREAD_NAME, daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Wait for the running save; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            kind = CheckpointError if isinstance(error, CheckpointError) else RuntimeError
            raise kind(f"The previous asynchronous checkpoint save failed: {error}") from error


WRITER_THREAD_NAME = "lockstep-checkpoint-writer"


def join_every_writer() -> None:
    """Wait for every background save of this process, also another Accelerator's (a notebook that builds a
    new Accelerator to resume): a checkpoint still being sealed would otherwise not count yet. Their errors
    stay with their own Accelerator."""
    for thread in threading.enumerate():
        if thread.name == WRITER_THREAD_NAME and thread is not threading.current_thread():
            thread.join()


def rank_work(
    write: Callable[[], None], staging: Path, rank: int, written: Mapping[str, dict[str, Any]] | None = None
) -> Callable[[], None]:
    """Wrap a rank's writes so that they always end with its marker, which carries ``written`` (the manifest
    entries of its files, filled by ``write``)."""

    def work() -> None:
        try:
            write()
        except BaseException as error:
            _write_failed_marker(staging, rank, f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
            raise
        _write_done_marker(staging, rank, dict(written or {}))

    return work


def _write_done_marker(staging: Path, rank: int, written: dict[str, dict[str, Any]]) -> None:
    """The marker with the rank's manifest entries (renamed into place: never read half written); on a full
    disk an empty one (creating a file takes no space there): its files are then hashed from the disk."""
    marker = done_marker(staging, rank)
    temporary = marker.with_name(marker.name + ".tmp")
    try:
        temporary.write_text(json.dumps(written))
        os.replace(temporary, marker)
    except OSError:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        marker.touch()


def _written_by(marker: Path) -> dict[str, dict[str, Any]]:
    text = marker.read_text()
    return json.loads(text) if text else {}


def _write_failed_marker(staging: Path, rank: int, text: str) -> None:
    """The marker with the error's text; on a full disk an empty one (creating a file takes no space
    there), which the committing process still sees."""
    marker = failed_marker(staging, rank)
    temporary = marker.with_name(marker.name + ".tmp")  # renamed: never read half written
    try:
        temporary.write_text(text)
        os.replace(temporary, marker)
    except OSError:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            marker.touch()
