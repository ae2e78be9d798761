"""Saving and loading a whole training state across all ranks, crash-consistently.

The protocol (every rank calls these functions together):

1. The main process empties a staging folder next to the destination; barrier.
2. The main process writes the shared files, every rank its own RNG and gradient files; a sharding
   backend writes its shards (every rank together, through ``save_shards``).
3. All ranks agree that every write succeeded (one small collective), so an error on one rank is
   raised on every rank instead of leaving the others in a barrier, and gather the manifest entries of
   their files, checksummed as they were written (:mod:`lockstep.checkpoint.hashed_write`).
4. The main process writes the manifest from those entries, renames the folder into place, moves the
   ``latest`` pointer and rotates; barrier. Every rank returns with the checkpoint folder final. Either
   every file was fsynced before the manifest, or (``fsync_in_background``) a thread fsyncs afterwards,
   changing nothing visible.

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

from lockstep.checkpoint import layout, single_pass
from lockstep.checkpoint.async_writer import AsyncCheckpointWriter, settle
from lockstep.checkpoint.disk_space import out_of_space_error
from lockstep.checkpoint.safe_load import UnsafeCheckpointError
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


ROTATION_SECONDS = 0.2
"""How long a ``durable="background"`` save spends deleting rotated-out checkpoints before it returns; what
is left then (a slow file system) is deleted by its thread, already renamed away."""


@dataclass(frozen=True)
class Rotation:
    """The deletion of older automatically named checkpoints that a save ends with, once committed."""

    rotate: Callable[[float | None], object]
    """Deletes them (within the given seconds, the rest renamed away; None: all now)."""
    keeps_a_durable_checkpoint: bool
    """Whether it keeps a checkpoint older than the new one (``total_limit`` of 2 or more). If not, a save
    whose fsync runs in the background makes the new checkpoint durable before it deletes the older ones:
    a power loss then never leaves no checkpoint."""


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
    fsync_in_background: bool = False,
    rotation: Rotation | None = None,
    save_shards: Callable[[Path], None] | None = None,
) -> int:
    """Write a checkpoint to ``final_dir`` on every rank together; returns the bytes snapshotted.

    ``collect(staging)`` gives what the checkpoint holds, once the staging folder exists: the Accelerator's
    save hooks run there and may write files of their own into ``staging``, which are committed (and
    covered by the manifest) with the rest. ``writer`` runs this process's background work: the previous
    one is waited for first, and its error raised on every rank. With ``background``, only the snapshot
    happens now and the files are written and committed by ``writer``. Otherwise every rank returns once the
    checkpoint is committed: its files, the manifest (checksums of the bytes as written), ``latest`` and the
    ``rotation``; with ``fsync_in_background`` nothing was fsynced then, and ``writer`` makes it durable,
    which changes nothing visible (a save over an existing folder fsyncs before it returns all the same: the
    new files cannot replace a committed checkpoint before they are durable). ``save_shards(staging)`` is the
    backend's collective write of its own shards, done now in any case. ``storage`` commits the staged files
    (default: a local folder).

    A failure on any rank (a full disk included) is raised on every rank, the staging folder is removed and
    nothing is rotated: the previous checkpoint stays the newest valid one. A background failure is raised,
    on every rank, by the next save (or ``writer.wait()``).
    """
    storage = storage or LocalStorage()
    if writer is not None:
        raise_background_failure(state, writer)
    background = background and writer is not None
    if fsync_in_background and (
        background or writer is None or _main_process_finds(state, storage, final_dir)
    ):
        fsync_in_background = False  # (decided alike on every rank: the main process's view of the folder)
    # On an object store only the main process commits; on a (shared) folder every writer of shared files.
    commits = writes_shared_files and (storage.node_local or state.is_main_process)
    staged: list[Path] = []
    agree(
        state,
        _attempt(lambda: staged.append(storage.prepare(final_dir, main=commits))),
        "Preparing the save",
    )
    guard = _SaveGuard(state=state, storage=storage, final_dir=final_dir, staging=staged[0], commits=commits)
    snapshots = _snapshots(guard, collect, writes_shared_files, safe_serialization, copy=background)
    if save_shards is not None:
        # A collective (also when the rest is written in the background); DCP raises on every rank if one fails.
        guard.collective(lambda: save_shards(guard.staging))
    nbytes = sum(snap.nbytes() for snap in snapshots)
    written: dict[str, dict[str, Any]] = {}

    def write() -> None:
        for snap in snapshots:
            written.update(write_snapshot(snap, guard.staging))

    work = storage.rank_writer(
        guard.converting(write),
        guard.staging,
        final_dir,
        state.process_index,
        background=background,
        written=written,
    )
    committer = _Committer(guard, step=step, move_latest_pointer=move_latest_pointer, rotation=rotation)
    if writer is not None and background:
        writer.start(
            guard.in_background(work, guard.converting(lambda: committer.commit(ASYNC_TIMEOUT_SECONDS, {})))
        )
        return nbytes
    guard.run(f"Saving the checkpoint {final_dir}", work)
    known = _everyones(state, written, writes_shared_files)
    if writer is None or not fsync_in_background:
        guard.run(f"Committing the checkpoint {final_dir}", lambda: committer.commit(None, known))
        return nbytes
    durability: list[Callable[[], None] | None] = []
    guard.run(
        f"Committing the checkpoint {final_dir}",
        lambda: durability.append(committer.commit_deferring_fsync(known)),
    )
    if durability[0] is not None:
        writer.start(_durability(durability[0], final_dir))
    return nbytes


def _snapshots(
    guard: _SaveGuard,
    collect: Callable[[Path], TrainingObjects],
    writes_shared_files: bool,
    safe_serialization: bool,
    *,
    copy: bool,
) -> list[Snapshot]:
    """What this rank writes, collected (save hooks included) and snapshotted, agreed by every rank."""
    final_dir, state = guard.final_dir, guard.state
    collected: list[TrainingObjects] = []
    guard.run(f"Collecting the state for {final_dir}", lambda: collected.append(collect(guard.staging)))
    snapshots: list[Snapshot] = []

    def snapshot() -> None:
        if writes_shared_files:
            snapshots.append(snapshot_shared(collected[0], safe_serialization=safe_serialization, copy=copy))
        snapshots.append(snapshot_rank(collected[0], rank=state.process_index))

    guard.run(f"Saving the checkpoint {final_dir}", snapshot)
    guard.needed = sum(snap.tensor_bytes() for snap in snapshots)
    return snapshots


def _everyones(
    state: PartialState, written: dict[str, dict[str, Any]], writes_shared_files: bool
) -> dict[str, dict[str, Any]]:
    """Every rank's manifest entries of the files it wrote (one all-gather of a small dict). When several
    ranks write the shared files (``save_on_each_node``: a copy on each node's own disk), the entries of this
    node's ranks only: each node's folder holds its own copy and its own ranks' files."""
    if not state.use_distributed:
        return dict(written)
    node = state.process_index - state.local_process_index  # ranks are contiguous per node
    parts = gather_object([(node, writes_shared_files, written)])
    each_node = sum(1 for _, shared, _ in parts if shared) > 1
    merged: dict[str, dict[str, Any]] = {}
    for part_node, _, entries in parts:
        if not each_node or part_node == node:
            merged.update(entries)
    return merged


@dataclass
class _Committer:
    """The committing process's end of a save (the others' calls do nothing)."""

    guard: _SaveGuard
    step: int
    move_latest_pointer: bool
    rotation: Rotation | None

    def commit(self, wait_seconds: float | None, known: dict[str, dict[str, Any]]) -> None:
        """Commit durably (manifest after every file's fsync), then rotate."""
        guard = self.guard
        if not guard.commits:
            return
        guard.storage.commit(
            guard.staging,
            guard.final_dir,
            world_size=guard.state.num_processes,
            step=self.step,
            move_latest_pointer=self.move_latest_pointer,
            wait_seconds=wait_seconds,
            known=known,
        )
        if self.rotation is not None:  # only once the new checkpoint is committed
            self.rotation.rotate(None)

    def commit_deferring_fsync(self, known: dict[str, dict[str, Any]]) -> Callable[[], None] | None:
        """Commit and rotate now, without fsync; returns the fsync to run on the thread (None: nothing left)."""
        guard = self.guard
        if not guard.commits:
            return None
        durability = guard.storage.commit_deferring_fsync(
            guard.staging,
            guard.final_dir,
            world_size=guard.state.num_processes,
            step=self.step,
            move_latest_pointer=self.move_latest_pointer,
            known=known,
        )
        if self.rotation is None:
            return durability
        if durability is not None and not self.rotation.keeps_a_durable_checkpoint:
            durability()  # the older checkpoints go: the new one must survive a power loss first
            durability = None
        self.rotation.rotate(None if durability is None else ROTATION_SECONDS)
        return durability


def _durability(make_durable: Callable[[], None], final_dir: Location) -> Callable[[], None]:
    """The thread's job after a commit that deferred its fsync; a failure says what it means."""

    def run() -> None:
        try:
            make_durable()
        except OSError as error:
            raise layout.CheckpointError(
                f"Checkpoint {final_dir} is in place and loads, but making it durable failed ({error}): a power "
                "loss may lose it. Check that disk before relying on this checkpoint."
            ) from error

    return run


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
    *,
    before: int | None = None,
) -> Location:
    """The folder to load, verified by the main process and agreed by all ranks (``before``: the newest of
    the ``checkpoint_{i}`` with ``i < before``)."""
    return _choose(state, input_dir, automatic_root, storage or LocalStorage(), checksums=True, before=before)


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
    before: int | None = None,
) -> Location:
    choice: list[Any] = [None, None]
    options: dict[str, Any] = {} if checksums else {"checksums": False}  # LocalStorage's option
    if before is not None:
        options["before"] = before
    if state.is_main_process:
        try:
            if input_dir is not None:
                storage.check(input_dir, **({} if checksums else {"checksums": False}))
                choice[0] = str(input_dir)
            elif automatic_root is not None:
                choice[0] = str(storage.newest_valid(automatic_root, **options))
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
    return storage.location(choice[0])


def _unreadable(
    folder: Path, error: Exception, failures: list[tuple[Path, BaseException]]
) -> layout.CheckpointError | None:
    """A checkpoint file that could not be read (torn, truncated, not what its name says) as the
    :class:`CheckpointError` naming it, which a ``load_state()`` without a folder falls back from; None for
    errors that are not a file's read (the objects do not match the checkpoint), and for a refused pickle."""
    if isinstance(error, (layout.CheckpointError, UnsafeCheckpointError)):
        return None
    path = single_pass.failed_file(error, failures)
    if path is None:
        return None
    name = path.relative_to(folder).as_posix() if path.is_relative_to(folder) else str(path)
    return layout.CheckpointError(
        f"Checkpoint {folder}: {name} cannot be read ({type(error).__name__}: {error})"
    )


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
        with single_pass.recording_read_failures() as failures:
            try:
                result["models"] = read_models()
                result["counters"] = load_shared_files(objects, folder, positions=positions)
                result["rank"] = load_rank_files(folder, rank=state.process_index)
            except Exception as error:
                unreadable = _unreadable(folder, error, failures)
                if unreadable is None:
                    raise
                raise unreadable from error

    agree(state, _attempt(read), f"Loading the checkpoint {folder}")
    apply_models(result["models"])
    counters, rank = result["counters"], result["rank"]
    if "step" not in counters and rank.step is not None:
        counters["step"] = rank.step
    return counters, rank.gradients
