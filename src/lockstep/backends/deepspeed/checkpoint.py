"""The DeepSpeed backend's checkpoint files: each engine's own checkpoint, inside lockstep's staging folder.

Engine ``i`` writes ``deepspeed_{i}/engine/`` with ``engine.save_checkpoint`` (every process its ZeRO
partition of the optimizer state, the main process the module's state), so lockstep's manifest, atomic
rename, rotation and ``latest`` pointer cover the files like any others; ``load_state`` checks that the
folder is there on every process before any engine reads it, then ``engine.load_checkpoint`` restores the
weights, the optimizer (its fp32 master copy and moments) and a scheduler the engine steps. RNG, dataloader
positions, schedulers the engine does not step and registered objects are lockstep's own files beside it.
A ZeRO 1-3 checkpoint loaded on another number of processes goes through DeepSpeed's universal checkpoint
(:mod:`.universal`).

DeepSpeed's files are pickles that DeepSpeed unpickles itself: lockstep checks them against the manifest's
checksums before they are read, so a file that was not written by the save is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lockstep.checkpoint.layout import read_manifest
from lockstep.errors import CheckpointError

ENGINE_FOLDER = "deepspeed_{index}"
TAG = "engine"


def engine_folder(folder: Path, index: int) -> Path:
    return folder / ENGINE_FOLDER.format(index=index)


def save_engine(engine: Any, folder: Path, index: int, *, frozen_left_out: bool = False) -> None:
    """Write engine ``index``'s checkpoint into ``folder`` (a collective: every process calls it); without
    the module's frozen parameters with ``frozen_left_out`` (DeepSpeed's ``exclude_frozen_parameters``)."""
    engine.save_checkpoint(
        str(engine_folder(folder, index)),
        tag=TAG,
        client_state={},
        save_latest=False,
        exclude_frozen_parameters=frozen_left_out,
    )


def check_engine_files(folder: Path, index: int) -> None:
    """Raise when engine ``index``'s checkpoint is missing from ``folder``."""
    tagged = engine_folder(folder, index) / TAG
    if not tagged.is_dir() or not any(tagged.iterdir()):
        raise CheckpointError(
            f"Checkpoint {folder} has no DeepSpeed engine files for model {index} ({tagged} is missing): it was "
            "not saved by the DeepSpeed backend. Load it with the backend that saved it."
        )


def saved_world_size(folder: Path) -> int:
    """The number of processes that saved checkpoint ``folder``."""
    return read_manifest(folder).world_size


def load_engine(engine: Any, folder: Path, index: int) -> None:
    """Restore engine ``index`` from ``folder`` (a collective); a module saved without its frozen parameters
    (whose keys ``load_state`` checked) loads with ``strict=False``, its frozen base left as it is."""
    from lockstep.checkpoint.frozen_base import saved_without_frozen

    path, _ = engine.load_checkpoint(
        str(engine_folder(folder, index)),
        tag=TAG,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_strict=not saved_without_frozen(folder, index),
    )
    if path is None:
        raise CheckpointError(
            f"DeepSpeed could not load the engine checkpoint in {engine_folder(folder, index)}."
        )
