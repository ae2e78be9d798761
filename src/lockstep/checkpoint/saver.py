"""Saving and loading a whole training state across all ranks, crash-consistently.

The protocol (every rank calls these functions together):

1. The main process empties a staging folder next to the destination; barrier.
2. The main process writes the shared files, every rank its own RNG and gradient files.
3. All ranks agree that every write succeeded (one small collective), so an error on one rank is
   raised on every rank instead of leaving the others in a barrier.
4. The main process writes the manifest, renames the folder into place and moves the ``latest`` pointer;
   barrier.

Loading: the main process picks the folder (the newest valid one when none is named) and verifies its
manifest; the choice, or the error, is sent to every rank; then each rank restores its state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint import layout
from lockstep.checkpoint import sharded as shards
from lockstep.checkpoint.async_writer import AsyncCheckpointWriter, rank_work, wait_for_ranks
from lockstep.checkpoint.model_files import load_model_files
from lockstep.checkpoint.safe_load import safe_torch_load
from lockstep.checkpoint.training_state import (
    Snapshot,
    TrainingObjects,
    indexed,
    load_rank_files,
    load_shared_files,
    model_folder,
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
    raise RuntimeError(f"{action} failed on {len(failed)} of {state.num_processes} processes: {details}")


def _attempt(function: Callable[[], Any]) -> BaseException | None:
    try:
        function()
    except Exception as error:
        return error
    return None


def save_checkpoint(
    objects: TrainingObjects,
    final_dir: Path,
    *,
    state: PartialState,
    weights: Sequence[dict[str, torch.Tensor] | None],
    writes_shared_files: bool,
    move_latest_pointer: bool,
    step: int,
    safe_serialization: bool = True,
    writer: AsyncCheckpointWriter | None = None,
    after_commit: Callable[[], None] | None = None,
) -> int:
    """Write a checkpoint to ``final_dir`` on every rank together; returns the bytes snapshotted.

    With ``writer``, only the snapshot happens now and the files are written in the background.
    """
    if writer is not None:
        writer.wait()
    staging = layout.staging_dir_for(final_dir)
    agree(
        state,
        _attempt(lambda: layout.prepare_staging(final_dir)) if writes_shared_files else None,
        "Preparing the save",
    )
    snapshots: list[Snapshot] = []
    optimizer_states = _gather_full_optimizer_states(objects)

    def snapshot() -> None:
        copy = writer is not None
        if writes_shared_files:
            snapshots.append(
                snapshot_shared(
                    objects,
                    weights=weights,
                    safe_serialization=safe_serialization,
                    copy=copy,
                    optimizer_states=optimizer_states,
                )
            )
        snapshots.append(snapshot_rank(objects, rank=state.process_index))

    agree(state, _attempt(snapshot), f"Saving the checkpoint {final_dir}")
    if objects.sharded is not None and objects.sharded.sharded_state_dict:
        # DCP is a collective: every process writes its own shards now, in parallel (also when the rest of
        # the checkpoint is written in the background). DCP raises on every rank if one fails.
        models, optimizers = _sharded_pairs(objects)
        shards.save_sharded(models, optimizers, staging)

    def commit() -> None:
        if writes_shared_files:
            layout.write_manifest(staging, world_size=state.num_processes, step=step)
            layout.commit(staging, final_dir, move_latest_pointer=move_latest_pointer)
            if after_commit is not None:
                after_commit()

    def write() -> None:
        for snap in snapshots:
            write_snapshot(snap, staging)

    if writer is None:
        agree(state, _attempt(write), f"Saving the checkpoint {final_dir}")
        agree(state, _attempt(commit), f"Committing the checkpoint {final_dir}")
    else:
        work = rank_work(write, staging, state.process_index)

        def background() -> None:
            work()
            if writes_shared_files:
                wait_for_ranks(staging, state.num_processes, timeout=ASYNC_TIMEOUT_SECONDS)
                commit()

        writer.start(background)
    return sum(snap.nbytes() for snap in snapshots)


def choose_checkpoint(state: PartialState, input_dir: Path | None, automatic_root: Path | None) -> Path:
    """The folder to load, verified by the main process and agreed by all ranks."""
    choice: list[Any] = [None, None]
    if state.is_main_process:
        try:
            if input_dir is not None:
                layout.verify(input_dir)
                choice[0] = str(input_dir)
            elif automatic_root is not None:
                choice[0] = str(layout.newest_valid_checkpoint(automatic_root))
            else:
                raise ValueError(
                    "load_state() needs input_dir=, or a project_dir with "
                    "ProjectConfiguration(automatic_checkpoint_naming=True) to find the newest checkpoint."
                )
        except (layout.CheckpointError, FileNotFoundError, ValueError) as error:
            choice[1] = (type(error).__name__, str(error))
    if state.use_distributed:
        broadcast_object_list(choice, from_process=0)
    if choice[1] is not None:
        kind, message = choice[1]
        raise {"CheckpointError": layout.CheckpointError, "FileNotFoundError": FileNotFoundError}.get(
            kind, ValueError
        )(message)
    return Path(choice[0])


def load_checkpoint(
    objects: TrainingObjects, folder: Path, *, state: PartialState, models_to_load: Sequence[int]
) -> tuple[dict[str, Any], bool]:
    """Restore every object from ``folder`` on every rank; returns (counters, rank state found)."""
    result: dict[str, Any] = {}
    full_states: dict[str, dict[int, Any]] = {"models": {}, "optimizers": {}}

    def read() -> None:
        result["counters"] = load_shared_files(objects, folder, models_to_load=models_to_load)
        result["rank_found"] = load_rank_files(objects, folder, rank=state.process_index, device=state.device)
        if objects.sharded is not None and not objects.sharded.sharded_state_dict and state.is_main_process:
            full_states.update(_read_full_states(objects, folder, models_to_load))

    agree(state, _attempt(read), f"Loading the checkpoint {folder}")
    if objects.sharded is not None:
        _load_sharded_objects(objects, folder, state, models_to_load, full_states)
    return result["counters"], result["rank_found"]


# -- sharded (FSDP) models and optimizers ------------------------------------------------------------
def _sharded_pairs(
    objects: TrainingObjects, models_to_load: Sequence[int] | None = None
) -> tuple[list[tuple[int, Any]], list[tuple[int, Any, Any]]]:
    assert objects.sharded is not None
    chosen = objects.sharded_model_indices()
    if models_to_load is not None:
        chosen &= set(models_to_load)
    models = [(i, objects.models[i]) for i in sorted(chosen)]
    optimizers = [
        (i, objects.sharded.model_of(o), o)
        for i, o in enumerate(objects.optimizers)
        if i in objects.sharded_optimizer_indices()
    ]
    return models, optimizers


def _gather_full_optimizer_states(objects: TrainingObjects) -> dict[int, Any]:
    """FULL_STATE_DICT: every sharded optimizer's whole state on the main process (a collective)."""
    if objects.sharded is None or objects.sharded.sharded_state_dict:
        return {}
    _, optimizers = _sharded_pairs(objects)
    return {i: shards.full_optimizer_state(model, optimizer) for i, model, optimizer in optimizers}


def _read_full_states(
    objects: TrainingObjects, folder: Path, models_to_load: Sequence[int]
) -> dict[str, dict[int, Any]]:
    models, optimizers = _sharded_pairs(objects, models_to_load)
    return {
        "models": {i: load_model_files(model_folder(folder, i)) for i, _ in models},
        "optimizers": {
            i: safe_torch_load(folder / indexed("optimizer", i, ".bin")) for i, _, _ in optimizers
        },
    }


def _load_sharded_objects(
    objects: TrainingObjects,
    folder: Path,
    state: PartialState,
    models_to_load: Sequence[int],
    full_states: dict[str, dict[int, Any]],
) -> None:
    assert objects.sharded is not None
    models, optimizers = _sharded_pairs(objects, models_to_load)
    if objects.sharded.sharded_state_dict:
        shards.load_sharded(models, optimizers, folder)
        return
    distributed = state.use_distributed
    for i, model in models:
        shards.load_full_model(model, full_states["models"].get(i, {}), distributed=distributed)
    for i, model, optimizer in optimizers:
        shards.load_full_optimizer(
            model, optimizer, full_states["optimizers"].get(i, {}), distributed=distributed
        )
