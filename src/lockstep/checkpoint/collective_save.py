"""Saving and loading a whole training state across all ranks, crash-consistently.

The protocol (every rank calls these functions together):

1. The main process empties a staging folder next to the destination; barrier.
2. The main process writes the shared files, every rank its own RNG and gradient files; a sharding
   backend writes its shards (every rank together, through ``save_shards``).
3. All ranks agree that every write succeeded (one small collective), so an error on one rank is
   raised on every rank instead of leaving the others in a barrier.
4. The main process writes the manifest, renames the folder into place and moves the ``latest`` pointer;
   barrier.

Loading: the main process picks the folder (the newest valid one when none is named) and verifies its
manifest; the choice, or the error, is sent to every rank; then each rank restores its state, reading its
files inside the error agreement and then restoring what needs every rank together (sharded state).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint import layout
from lockstep.checkpoint.async_writer import AsyncCheckpointWriter, settle
from lockstep.checkpoint.disk_space import out_of_space_error
from lockstep.checkpoint.storage import CheckpointStorage, LocalStorage, Location
from lockstep.checkpoint.training_state import (
    Snapshot,
    TrainingObjects,
    load_rank_files,
    load_shared_files,
    snapshot_rank,
    snapshot_shared,
    write_snapshot,
)
from lockstep.collectives import broadcast_object_list, gather_object
from lockstep.state import PartialState

ASYNC_TIMEOUT_SECONDS = 3600.0
"""How long the main process's writer waits for the other ranks' files."""


def agree(state: PartialState, error: BaseException | None, action: str) -> None:
    """Raise on every rank if ``action`` failed on any rank (one all-gather of a short status)."""
    status = None if error is None else f"{type(error).__name__}: {error}"
    statuses = gather_object([status]) if state.use_distributed else [status]
    failed = [(rank, text) for rank, text in enumerate(statuses) if text is not None]
    if not failed:
        return
    if error is not None and len(failed) == 1:
        raise error
    details = "; ".join(f"rank {rank}: {text}" for rank, text in failed)
    # a checkpoint that cannot be written (a full disk) stays a CheckpointError on every rank
    same = all(text.startswith(f"{layout.CheckpointError.__name__}: ") for _, text in failed)
    kind = layout.CheckpointError if same else RuntimeError
    raise kind(f"{action} failed on {len(failed)} of {state.num_processes} processes: {details}")


def _attempt(function: Callable[[], Any]) -> BaseException | None:
    try:
        function()
    except Exception as error:
        return error
    return None


def raise_background_failure(state: PartialState, writer: AsyncCheckpointWriter) -> None:
    """Every rank together: wait for ``writer``'s background save and raise its error, if it failed on any
    rank, on every rank (a thread's error alone would stop one rank and leave the others in a collective)."""
    agree(state, _attempt(writer.wait), "The previous asynchronous checkpoint save")


@dataclass
class _SaveGuard:
    """How one save fails: an error on any rank is raised on every rank, a full disk as one
    :class:`CheckpointError` (:mod:`lockstep.checkpoint.disk_space`), and the staging folder is removed, so
    nothing of a failed save remains and the previous checkpoint stays the newest valid one."""

    state: PartialState
    storage: CheckpointStorage
    final_dir: Location
    staging: Path
    commits: bool
    needed: int = 0
    """The bytes of this process's snapshot (named when the disk fills)."""

    def converting(self, function: Callable[[], Any]) -> Callable[[], None]:
        """``function``, raising a full disk as the CheckpointError that says so."""

        def run() -> None:
            try:
                function()
            except Exception as error:
                world = self.state.num_processes
                failure = out_of_space_error(
                    error,
                    checkpoint=self.final_dir,
                    staging=self.staging,
                    needed=self.needed,
                    process=f"process {self.state.process_index} of {world}" if world > 1 else "",
                )
                if failure is None:
                    raise
                raise failure from error

        return run

    def run(self, action: str, function: Callable[[], Any]) -> None:
        """Every rank runs ``function``, then agrees; on a failure anywhere the staging folder goes."""
        error = _attempt(self.converting(function))
        try:
            agree(self.state, error, action)
        except BaseException:
            self.discard()
            raise

    def collective(self, function: Callable[[], Any]) -> None:
        """A collective write that raises on every rank itself (DCP's)."""
        try:
            self.converting(function)()
        except BaseException:
            self.discard()
            raise

    def in_background(
        self, work: Callable[[], None], commit: Callable[[], None], *, markers: bool = True
    ) -> Callable[[], None]:
        """The writer thread's job: this rank's files, then (committing process) the commit; on a failure the
        committing process waits for every rank's marker (``markers``: the ranks write in the background
        too), then removes the staging folder."""

        def run() -> None:
            try:
                work()
                commit()
            except BaseException:
                if markers and self.commits and self.storage.node_local:
                    settle(self.staging, self.state.num_processes, timeout=ASYNC_TIMEOUT_SECONDS)
                self.discard()
                raise

        return run

    def discard(self) -> None:
        self.storage.discard(self.staging, main=self.commits)


def save_checkpoint(
    collect: Callable[[Path], TrainingObjects],
    final_dir: Location,
    *,
    storage: CheckpointStorage | None = None,
    state: PartialState,
    writes_shared_files: bool,
    move_latest_pointer: bool,
    step: int,
    safe_serialization: bool = True,
    writer: AsyncCheckpointWriter | None = None,
    background: bool = False,
    commit_in_background: bool = False,
    after_commit: Callable[[], None] | None = None,
    save_shards: Callable[[Path], None] | None = None,
) -> int:
    """Write a checkpoint to ``final_dir`` on every rank together; returns the bytes snapshotted.

    ``collect(staging)`` gives what the checkpoint holds, once the staging folder exists: the Accelerator's
    save hooks run there and may write files of their own into ``staging``, which are committed (and
    covered by the manifest) with the rest. ``writer`` runs this process's background saves: the previous
    one is waited for first, and its error raised on every rank; with ``background``, only the snapshot
    happens now and the files are written and committed by ``writer``. With ``commit_in_background`` (and no
    ``background``), the files are written now (handed to the OS) and ``writer`` makes them durable: fsync
    of every file, manifest, rename, ``latest`` and rotation; the checkpoint counts only once committed.
    ``save_shards(staging)`` is the backend's collective write of its own shards, done now in any case.
    ``storage`` commits the staged files (default: a local folder).

    A failure on any rank (a full disk included) is raised on every rank, the staging folder is removed and
    nothing is rotated: the previous checkpoint stays the newest valid one. A background save's failure is
    raised, on every rank, by the next save (or ``writer.wait()``).
    """
    storage = storage or LocalStorage()
    if writer is not None:
        raise_background_failure(state, writer)
    background = background and writer is not None
    if commit_in_background and not background and writer is not None:
        # Saving over an existing folder cannot show the new files before they are durable without losing the
        # old checkpoint to a crash: that save commits before it returns (decided by the main process for all).
        commit_in_background = not _main_process_finds(state, storage, final_dir)
    # On an object store only the main process commits; on a (shared) folder every writer of shared files.
    commits = writes_shared_files and (storage.node_local or state.is_main_process)
    staged: list[Path] = []
    agree(
        state,
        _attempt(lambda: staged.append(storage.prepare(final_dir, main=commits))),
        "Preparing the save",
    )
    guard = _SaveGuard(state=state, storage=storage, final_dir=final_dir, staging=staged[0], commits=commits)
    collected: list[TrainingObjects] = []
    guard.run(f"Collecting the state for {final_dir}", lambda: collected.append(collect(guard.staging)))
    snapshots: list[Snapshot] = []

    def snapshot() -> None:
        if writes_shared_files:
            copy = background
            snapshots.append(snapshot_shared(collected[0], safe_serialization=safe_serialization, copy=copy))
        snapshots.append(snapshot_rank(collected[0], rank=state.process_index))

    guard.run(f"Saving the checkpoint {final_dir}", snapshot)
    guard.needed = sum(snap.tensor_bytes() for snap in snapshots)
    if save_shards is not None:
        # A collective (also when the rest is written in the background); DCP raises on every rank if one fails.
        guard.collective(lambda: save_shards(guard.staging))

    def commit(wait_seconds: float | None) -> None:
        if commits:
            storage.commit(
                guard.staging,
                final_dir,
                world_size=state.num_processes,
                step=step,
                move_latest_pointer=move_latest_pointer,
                wait_seconds=wait_seconds,
            )
            if after_commit is not None:  # rotation: only once the new checkpoint is committed
                after_commit()

    def write() -> None:
        for snap in snapshots:
            write_snapshot(snap, guard.staging)

    work = storage.rank_writer(
        guard.converting(write), guard.staging, final_dir, state.process_index, background=background
    )
    if writer is not None and background:
        writer.start(guard.in_background(work, guard.converting(lambda: commit(ASYNC_TIMEOUT_SECONDS))))
        return sum(snap.nbytes() for snap in snapshots)
    guard.run(f"Saving the checkpoint {final_dir}", work)
    seal = _sealing(storage, final_dir, world_size=state.num_processes, step=step, latest=move_latest_pointer)
    after = after_commit or (lambda: None)  # rotation: only once the new checkpoint is committed
    if writer is None or not commit_in_background:
        guard.run(f"Committing the checkpoint {final_dir}", lambda: commit(None))
        return sum(snap.nbytes() for snap in snapshots)
    _publish_then_seal(guard, writer, commit=lambda: commit(None), seal=lambda: (seal(), after()))
    return sum(snap.nbytes() for snap in snapshots)


def _publish_then_seal(
    guard: _SaveGuard,
    writer: AsyncCheckpointWriter,
    *,
    commit: Callable[[], None],
    seal: Callable[[], None],
) -> None:
    """The end of a ``durable="background"`` save, once every rank's files are written (agreed): the
    committing process puts them in place and every rank returns once they are there (as the peers' saves
    leave them); the thread then runs ``seal`` (the whole ``commit`` where they could not be put in place)."""
    published: list[bool] = []
    guard.run(
        f"Saving the checkpoint {guard.final_dir}",
        lambda: published.append(guard.commits and guard.storage.publish(guard.staging, guard.final_dir)),
    )
    if guard.commits:
        finish = seal if published[0] else commit
        writer.start(guard.in_background(lambda: None, guard.converting(finish), markers=False))


def _sealing(
    storage: CheckpointStorage, final_dir: Location, *, world_size: int, step: int, latest: bool
) -> Callable[[], None]:
    """The background half of a published save: seal ``final_dir``; if that fails, remove it (unsealed, it
    never was a checkpoint, and the previous one stays the newest valid one)."""

    def seal() -> None:
        try:
            storage.seal(final_dir, world_size=world_size, step=step, latest=latest)
        except BaseException:
            storage.remove(final_dir)
            raise

    return seal


def _main_process_finds(state: PartialState, storage: CheckpointStorage, final_dir: Location) -> bool:
    """Whether ``final_dir`` exists, as the main process sees it, on every rank."""
    found = [storage.exists(final_dir) if state.is_main_process else None]
    if state.use_distributed:
        broadcast_object_list(found, from_process=0)
    return bool(found[0])


_AGREED_ERRORS: dict[str, type[Exception]] = {
    kind.__name__: kind
    for kind in (
        layout.CheckpointError,
        ValueError,
        FileNotFoundError,
        PermissionError,
        ConnectionError,
        TimeoutError,
        OSError,
    )
}
"""Errors choosing a checkpoint (the main process's) raised as themselves on every rank."""


def choose_checkpoint(
    state: PartialState,
    input_dir: Location | None,
    automatic_root: Location | None,
    storage: CheckpointStorage | None = None,
) -> Location:
    """The folder to load, verified by the main process and agreed by all ranks."""
    return _choose(state, input_dir, automatic_root, storage or LocalStorage(), checksums=True)


def choose_checkpoint_checksummed_while_read(
    state: PartialState,
    input_dir: Location | None,
    automatic_root: Location | None,
    storage: CheckpointStorage,
) -> tuple[Location, layout.ChecksumsOnAThread | layout.ChecksumsOnTheMainProcess | None]:
    """:func:`choose_checkpoint` for a local checkpoint, whose checksums the main process verifies on a thread
    while every rank reads it (the returned check, whose ``result()`` the other ranks get as None; None on
    every rank where there is nothing to verify later: other storages verify before, checkpoints written by
    Accelerate have no checksums). Presence and sizes are checked before, as always. The caller must agree
    on the check's result after reading."""
    if not isinstance(storage, LocalStorage):
        return _choose(state, input_dir, automatic_root, storage, checksums=True), None
    location = _choose(state, input_dir, automatic_root, storage, checksums=False)
    if layout.written_by_accelerate(Path(location)):
        return location, None
    if not state.is_main_process:
        return location, layout.ChecksumsOnTheMainProcess()
    return location, layout.ChecksumsOnAThread(Path(location))


def _choose(
    state: PartialState,
    input_dir: Location | None,
    automatic_root: Location | None,
    storage: CheckpointStorage,
    *,
    checksums: bool,
) -> Location:
    choice: list[Any] = [None, None]
    sizes_only = {} if checksums else {"checksums": False}  # LocalStorage's option
    if state.is_main_process:
        try:
            if input_dir is not None:
                storage.check(input_dir, **sizes_only)
                choice[0] = str(input_dir)
            elif automatic_root is not None:
                choice[0] = str(storage.newest_valid(automatic_root, **sizes_only))
            else:
                raise ValueError(
                    "load_state() needs input_dir=, or a project_dir with "
                    "ProjectConfiguration(automatic_checkpoint_naming=True) to find the newest checkpoint."
                )
        except Exception as error:  # raised on every rank below: the others must not wait in the broadcast
            choice[1] = (type(error).__name__, str(error))
    if state.use_distributed:
        broadcast_object_list(choice, from_process=0)
    if choice[1] is not None:
        kind, message = choice[1]
        if kind in _AGREED_ERRORS:
            raise _AGREED_ERRORS[kind](message)
        raise RuntimeError(f"{kind}: {message}")
    return Path(choice[0]) if storage.node_local else choice[0]


def load_checkpoint(
    objects: TrainingObjects,
    folder: Path,
    *,
    state: PartialState,
    read_models: Callable[[], Any],
    apply_models: Callable[[Any], None],
) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
    """Restore every object from ``folder`` on every rank; returns (counters, this rank's saved gradients,
    None when the checkpoint has no files for this rank). A checkpoint written by Accelerate has no
    loader positions and keeps its step with the RNG states; both are handled here.

    Args:
        objects: the schedulers, loaders, scaler and registered objects to restore.
        folder: the chosen checkpoint.
        state: the process state.
        read_models: the backend's reading of model and optimizer files (local; errors are agreed).
        apply_models: the backend's restoring of what needs every rank together, given what was read.
    """
    result: dict[str, Any] = {}
    positions = not layout.written_by_accelerate(folder)

    def read() -> None:
        result["models"] = read_models()
        result["counters"] = load_shared_files(objects, folder, positions=positions)
        result["rank"] = load_rank_files(folder, rank=state.process_index)

    agree(state, _attempt(read), f"Loading the checkpoint {folder}")
    apply_models(result["models"])
    counters, rank = result["counters"], result["rank"]
    if "step" not in counters and rank.step is not None:
        counters["step"] = rank.step
    return counters, rank.gradients
