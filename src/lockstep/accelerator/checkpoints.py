"""The Accelerator's checkpoint manager: which objects, which folder, which hooks.

The file formats and the crash-consistent protocol live in :mod:`lockstep.checkpoint`; the model and
optimizer state is the backend's business. This module decides what to save (everything prepared plus
registered objects) and where (``project_dir/checkpoints/checkpoint_{i}`` with automatic naming; a local
folder, or any fsspec URL such as ``s3://bucket/run``: see :mod:`lockstep.checkpoint.storage`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from lockstep.accelerator.accumulation import GradientAccumulation
from lockstep.accelerator.elastic_resume import (
    ACCUMULATION_COUNTER,
    OPTIMIZER_STEPS_COUNTER,
    after_resized_load,
    kept_scheduler_repeats,
)
from lockstep.accelerator.prepared import PreparedObjects
from lockstep.backends.base import Backend
from lockstep.backends.capabilities import Indexed, LiveRecovery, ShardedCheckpointIO
from lockstep.checkpoint import frozen_base, layout
from lockstep.checkpoint.async_writer import AsyncCheckpointWriter, join_every_writer
from lockstep.checkpoint.collective_save import (
    Rotation,
    agree,
    choose_checkpoint,
    choose_checkpoint_checksummed_while_read,
    load_checkpoint,
    raise_background_failure,
    save_checkpoint,
)
from lockstep.checkpoint.model_files import save_model_files
from lockstep.checkpoint.storage import CheckpointStorage, Location, storage_for, store_key
from lockstep.checkpoint.training_state import TrainingObjects
from lockstep.config.project import ProjectConfiguration
from lockstep.integrations.peft import is_peft_model, save_adapter_folder
from lockstep.state import PartialState

CHECKPOINTS_FOLDER = "checkpoints"
DURABLE_MODES = ("sync", "background")
logger = logging.getLogger("lockstep.checkpoint")


@dataclass(frozen=True)
class SaveReport:
    """What the last ``save_state`` cost the training loop."""

    folder: str
    stall_seconds: float
    """Time the training loop was stopped (the whole save, or only the snapshot when asynchronous)."""
    nbytes: int
    """Bytes of tensors in this process's snapshot."""
    asynchronous: bool


class CheckpointManager:
    """Saves and loads the training state of one Accelerator.

    Args:
        prepared: the prepared and registered objects.
        backend: the backend that owns model and optimizer state.
        state: the process state.
        project: where automatically named checkpoints go, and how many to keep.
        accumulation: the accumulation position, saved and restored with the state.
        keep_global_batch: on a resume on another number of processes, keep the global batch by changing the
            accumulation steps (:mod:`lockstep.accelerator.elastic_resume`).
        record_event: writes a text event to the run's trackers: the restart line of such a resume.
        live_recovery: the live recovery of this run (fault tolerance's layer, which keeps torchft's committed
            steps in every checkpoint), or None.
    """

    def __init__(
        self,
        *,
        prepared: PreparedObjects,
        backend: Backend,
        state: PartialState,
        project: ProjectConfiguration,
        accumulation: GradientAccumulation,
        keep_global_batch: bool = False,
        record_event: Callable[[str, int | None], None] | None = None,
        live_recovery: Callable[[], LiveRecovery | None] = lambda: None,
    ) -> None:
        self.live_recovery = live_recovery
        self.keep_global_batch = keep_global_batch
        self.record_event = record_event
        self.prepared = prepared
        self.backend = backend
        self.state = state
        self.project = project
        self.accumulation = accumulation
        # OrderedDicts: torch's RemovableHandle keeps a weak reference to the dict.
        self.save_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self.load_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self.writer = AsyncCheckpointWriter()
        self.last_save: SaveReport | None = None
        self.loaded_from: Location | None = None
        """The checkpoint the last ``load_state`` restored."""
        self._storages: dict[str, CheckpointStorage] = {}
        if project.project_dir is not None:
            self._probe(project.project_dir)

    def storage(self, location: Location) -> CheckpointStorage:
        """The storage serving ``location`` (one per URL scheme and bucket, built on first use)."""
        key = store_key(location)
        if key not in self._storages:
            self._storages[key] = storage_for(location)
        return self._storages[key]

    def _probe(self, location: Location) -> None:
        """Every process checks now, before training, that it can write ``location`` (bounded in time),
        unless its storage is a local folder. A storage that cannot be built (a missing fsspec backend, an
        unknown scheme) fails here too, on every process together."""
        error: BaseException | None = None
        try:
            storage = self.storage(location)
            if storage.local:  # decided alike on every process: the same location, the same storage
                return
            storage.probe()
        except (OSError, ImportError, ValueError) as failure:
            error = failure
        agree(self.state, error, f"Checking the checkpoint storage {os.fspath(location)}")

    def add_hook(self, hooks: dict[int, Callable[..., Any]], hook: Callable[..., Any]) -> RemovableHandle:
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    # -- where ------------------------------------------------------------------------------------
    def automatic_root(self) -> Location | None:
        """``project_dir/checkpoints`` (a path or a URL), or None without a project folder."""
        if self.project.project_dir is None:
            return None
        return self.storage(self.project.project_dir).join(self.project.project_dir, CHECKPOINTS_FOLDER)

    def save_target(self, output_dir: str | os.PathLike | None) -> tuple[Location, bool]:
        """(folder, whether it is automatically named)."""
        if self.project.automatic_checkpoint_naming:
            root = self.automatic_root()
            if root is None:
                raise ValueError(
                    "ProjectConfiguration(automatic_checkpoint_naming=True) needs a project_dir: pass "
                    "Accelerator(project_dir=...)."
                )
            return self.storage(root).join(root, f"checkpoint_{self.project.iteration}"), True
        if output_dir is None:
            raise ValueError(
                "save_state() needs output_dir=, or ProjectConfiguration(automatic_checkpoint_naming=True) with a "
                "project_dir to name checkpoints project_dir/checkpoints/checkpoint_{i}."
            )
        return self.storage(output_dir).location(output_dir), False

    # -- what -------------------------------------------------------------------------------------
    def _shared_objects(self) -> TrainingObjects:
        counters: dict[str, Any] = {
            "step": self.accumulation.step,
            "iteration": self.project.iteration,
            ACCUMULATION_COUNTER: self.accumulation.num_steps,
        }
        optimizers = list(self.prepared.optimizers)
        if all(hasattr(o, "steps_taken") for o in optimizers):
            counters[OPTIMIZER_STEPS_COUNTER] = [o.steps_taken for o in optimizers]
        live = self.live_recovery()
        if live is not None:  # fault tolerance: torchft's committed steps, so a full restart continues them
            counters[live.progress_key] = live.saved_progress()
        return TrainingObjects(
            schedulers=list(self.prepared.schedulers),
            dataloaders=list(self.prepared.dataloaders),
            scaler=self.backend.precision.scaler,
            custom=list(self.prepared.custom),
            counters=counters,
        )

    def _writes_shared_files(self) -> bool:
        return self.state.is_main_process or (
            self.project.save_on_each_node and self.state.is_local_main_process
        )

    # -- save -------------------------------------------------------------------------------------
    def save_state(
        self,
        output_dir: Any,
        safe_serialization: bool,
        async_save: bool = False,
        durable: str = "sync",
    ) -> str:
        """Save everything on every rank together; returns the checkpoint folder (``durable``: see
        :meth:`Accelerator.save_state`)."""
        if durable not in DURABLE_MODES:
            raise ValueError(
                f"save_state(durable={durable!r}) is invalid: it must be one of {', '.join(map(repr, DURABLE_MODES))}. "
                "'sync' returns once the checkpoint is committed; 'background' once its files are written, and "
                "commits it in the background."
            )
        started = time.monotonic()
        folder, automatic = self.save_target(output_dir)
        models, optimizers = list(self.prepared.models), list(self.prepared.optimizers)
        left_out = self._frozen_bases(models)  # a collective under sharding: every rank, now
        weights: list[Any] = self.backend.model_state_dicts(models)  # may be a collective: every rank, now
        for index, entry in left_out.items():
            if weights[index] is not None:
                weights[index] = frozen_base.without_frozen(weights[index], entry)
        storage = self.storage(folder)
        # save_on_each_node is for node-local disks; an object store gets the shared files once.
        writes_shared = self._writes_shared_files() if storage.node_local else self.state.is_main_process
        nbytes = save_checkpoint(
            lambda staging: self._collect(models, weights, staging, left_out),
            folder,
            storage=storage,
            state=self.state,
            writes_shared_files=writes_shared,
            move_latest_pointer=automatic,
            step=self.accumulation.step,
            safe_serialization=safe_serialization,
            writer=self.writer,
            background=async_save,
            fsync_in_background=durable == "background",
            rotation=self._rotation(storage, folder) if automatic and writes_shared else None,
            save_shards=self._shard_writer(models, optimizers, set(left_out)),
        )
        if automatic:
            self.project.iteration += 1
        self._report(folder, time.monotonic() - started, nbytes, async_save)
        return str(folder)

    def _rotation(self, storage: CheckpointStorage, folder: Location) -> Rotation:
        """The deletion of the automatically named checkpoints beyond ``total_limit`` after saving ``folder``."""
        limit = self.project.total_limit
        root = storage.parent(folder)
        return Rotation(
            rotate=lambda within: storage.rotate(root, limit, within_seconds=within),
            keeps_a_durable_checkpoint=limit is None or limit >= 2,
        )

    def _frozen_bases(self, models: list[nn.Module]) -> dict[int, frozen_base.Entry]:
        """The models saved without their frozen base (peft models, unless ``save_frozen_base``), by index,
        with the keys saved and the base's fingerprint (:mod:`lockstep.checkpoint.frozen_base`)."""
        if self.project.save_frozen_base:
            return {}
        return frozen_base.describe([self.backend.unwrap_model(m, keep_torch_compile=False) for m in models])

    def _shard_writer(
        self, models: list[nn.Module], optimizers: list[Any], frozen_left_out: set[int]
    ) -> Callable[[Path], None] | None:
        """Writes every process's own shards (a collective) when the backend shards its state; else None."""
        io = self.backend.capability(ShardedCheckpointIO)
        if io is None:
            return None
        return lambda staging: io.save_shards(
            list(enumerate(models)), list(enumerate(optimizers)), staging, frozen_left_out=frozen_left_out
        )

    def _shard_reader(self, models: Indexed, optimizers: Indexed) -> Callable[[Any], None]:
        """Restores what every process reads together when the backend shards its state; else nothing."""
        io = self.backend.capability(ShardedCheckpointIO)
        if io is None:
            return lambda loaded: None
        return lambda loaded: io.apply_model_states(models, optimizers, loaded)

    def _collect(
        self,
        models: list[nn.Module],
        weights: list[Any],
        staging: Path,
        left_out: dict[int, frozen_base.Entry],
    ) -> TrainingObjects:
        """What this save holds: the backend's model and optimizer state (after the save hooks), the
        shared objects, this rank's pending gradients, and the record of the frozen bases left out.

        The save hooks get the staging folder as ``output_dir``: files they write there (a model saved in
        its own format, say) are committed, checksummed and rotated with the checkpoint.
        """
        hooked_models = list(models)
        for hook in self.save_hooks.values():
            hook(hooked_models, weights, str(staging))
        # A hook may take models out of `weights` (it saved them itself): keep the remaining ones in place.
        objects = self._shared_objects()
        objects.model_states = [weights[i] if i < len(weights) else None for i in range(len(models))]
        objects.optimizer_states = self.backend.optimizer_states(list(self.prepared.optimizers))
        mid_accumulation = not self.accumulation.gradient_state.sync_gradients
        objects.gradients = lambda: self.backend.pending_gradients(models, mid_accumulation=mid_accumulation)
        if left_out:
            objects.records[frozen_base.RECORD_FILE] = frozen_base.record_json(left_out)
        return objects

    def _report(self, folder: Location, stall: float, nbytes: int, asynchronous: bool) -> None:
        self.last_save = SaveReport(
            folder=str(folder), stall_seconds=stall, nbytes=nbytes, asynchronous=asynchronous
        )
        logger.info(
            "checkpoint %s: training stalled %.3f s (%d bytes, %s)",
            folder,
            stall,
            nbytes,
            "written in the background" if asynchronous else "written",
        )

    def wait(self) -> None:
        """Wait for a background save to be committed, or made durable (raises its error, if any)."""
        self.writer.wait()

    def raise_background_failure(self) -> None:
        """Every rank together: raise a failed background save's error on every rank (the training loop's
        ``should_stop`` calls this once some rank's save failed)."""
        raise_background_failure(self.state, self.writer)

    # -- load -------------------------------------------------------------------------------------
    def load_state(self, input_dir: Any) -> None:
        """Restore the chosen checkpoint on every rank together.

        Without ``input_dir``, a newest checkpoint that turns out corrupt or holds a file that cannot be read
        is replaced by the newest older one that verifies, loaded over what was read (a warning names the
        file); a named one raises :class:`CheckpointError` saying so.
        """
        # every rank's background work is done before choosing (its failure raised on every rank), and any
        # other Accelerator's of this process too
        raise_background_failure(self.state, self.writer)
        join_every_writer()
        root = self.automatic_root()
        if input_dir is not None:
            input_dir = self.storage(input_dir).location(input_dir)
        where = input_dir if input_dir is not None else root
        storage = self.storage(where) if where is not None else storage_for(".")
        location, checksums = choose_checkpoint_checksummed_while_read(self.state, input_dir, root, storage)
        failure = self._read(storage, location, checksums)
        while failure is not None:
            if input_dir is not None:
                raise _read_over(failure)
            failed = location
            try:
                location = choose_checkpoint(self.state, None, root, storage, before=_number(storage, failed))
            except FileNotFoundError:  # nothing older verifies: the failure is the answer
                raise _read_over(failure) from None
            if self.state.is_main_process:
                warnings.warn(
                    f"Skipped 1 newer checkpoint(s) that cannot be loaded, using {location}: {failure}",
                    UserWarning,
                    stacklevel=3,
                )
            failure = self._read(storage, location, None)  # (verified before it is read)
        self.loaded_from = location
        match = layout._AUTOMATIC_NAME.match(storage.name(location))
        if self.project.automatic_checkpoint_naming and match:
            self.project.iteration = int(match.group(1)) + 1

    def _read(
        self,
        storage: Any,
        location: Any,
        checksums: layout.ChecksumsOnAThread | layout.ChecksumsOnTheMainProcess | None,
    ) -> layout.CheckpointError | None:
        """Read ``location`` into every object while the main process verifies its checksums (``checksums``,
        when not verified before). Returns, on every rank alike, the :class:`CheckpointError` of a corrupt
        file (which explains any error it caused) or of a file that could not be read, both naming it; other
        errors (the objects do not match the checkpoint) are raised."""
        read_error = None
        try:
            with checksums.reading() if checksums is not None else contextlib.nullcontext():
                self._load_location(storage, location)
        except Exception as error:  # raised on every rank together; a corrupt file explains it better
            read_error = error
        corrupt = checksums.result() if checksums is not None else None
        try:
            agree(self.state, corrupt, f"Verifying the checksums of {location}")
        except layout.CheckpointError as error:
            return error
        if isinstance(read_error, layout.CheckpointError):
            return read_error
        if read_error is not None:
            raise read_error
        return None

    def _load_location(self, storage: Any, location: Any) -> None:
        with contextlib.ExitStack() as stack:
            local: list[Path] = []
            error = None
            try:  # an object store's checkpoint is downloaded and its checksums verified first
                local.append(stack.enter_context(storage.readable(location)))
            except Exception as failure:
                error = failure
            agree(self.state, error, f"Reading the checkpoint {location}")
            self._load_from(local[0])

    def _load_from(self, folder: Path) -> None:
        """Restore every object from the local checkpoint folder ``folder``."""
        models: list[nn.Module] = list(self.prepared.models)
        hooked_models = list(models)
        for hook in self.load_hooks.values():
            hook(hooked_models, str(folder))
        to_load = [(i, model) for i, model in enumerate(models) if any(model is m for m in hooked_models)]
        # Every rank together (a base's fingerprint is a collective under sharding), before any file is read.
        frozen_base.check(
            folder, [(i, self.backend.unwrap_model(m, keep_torch_compile=False)) for i, m in to_load]
        )
        optimizers = list(enumerate(self.prepared.optimizers))
        if layout.written_by_accelerate(folder) and self.state.is_main_process:
            logger.warning(
                "%s was written by Hugging Face Accelerate: it is loaded without lockstep's guarantees: no "
                "manifest (files are not checksummed), and no dataloader positions (prepared loaders start the "
                "epoch from its beginning; skip the batches already seen with skip_first_batches).",
                folder,
            )
        counters, gradients = load_checkpoint(
            self._shared_objects(),
            folder,
            state=self.state,
            read_models=lambda: self.backend.read_model_states(to_load, optimizers, folder),
            apply_models=self._shard_reader(to_load, optimizers),
        )
        if gradients is not None:
            self.backend.restore_gradients(models, gradients)
        self.accumulation.step = int(counters.get("step", 0))
        for optimizer, taken in zip(self.prepared.optimizers, counters.get(OPTIMIZER_STEPS_COUNTER, [])):
            if hasattr(optimizer, "steps_taken"):
                optimizer.steps_taken = int(taken)
        live = self.live_recovery()
        if live is not None and live.progress_key in counters:
            live.load_saved_progress(counters[live.progress_key])
        script_steps = self.accumulation.num_steps  # before a resize changes it to keep the global batch
        line = after_resized_load(
            self.prepared.dataloaders,
            folder=folder,
            counters=counters,
            accumulation=self.accumulation,
            keep_global_batch=self.keep_global_batch,
            is_main_process=self.state.is_main_process,
            num_processes=self.state.num_processes,
        )
        if line is not None and self.record_event is not None:
            self.record_event(line, int(counters.get("step", 0)))  # the saved step, as the line says
        if self.keep_global_batch:
            repeats = kept_scheduler_repeats(
                self.state.num_processes, self.accumulation.num_steps, script_steps
            )
            for scheduler in self.prepared.schedulers:
                if not getattr(scheduler, "split_batches", True):
                    scheduler.num_processes = repeats

    # -- export -----------------------------------------------------------------------------------
    def save_model(
        self, model: nn.Module, save_directory: Any, max_shard_size: int | str, safe_serialization: bool
    ) -> None:
        """Write the unwrapped model's weights as (sharded) safetensors on the main process; a peft model's
        adapter as peft writes it (``adapter_config.json``, ``adapter_model.safetensors``), gathered from every
        process."""
        unwrapped = self.backend.unwrap_model(model, keep_torch_compile=False)
        state_dict = self.backend.full_state_dict(unwrapped)
        if self.state.is_main_process and is_peft_model(unwrapped):
            save_adapter_folder(unwrapped, state_dict, save_directory, safe_serialization)
        elif self.state.is_main_process:
            save_model_files(
                state_dict,
                save_directory,
                max_shard_size=max_shard_size,
                safe_serialization=safe_serialization,
            )
        self.state.wait_for_everyone()


def _read_over(failure: layout.CheckpointError) -> layout.CheckpointError:
    """The error of a checkpoint that was read, in part, before it turned out corrupt or unreadable."""
    return layout.CheckpointError(
        f"{str(failure).rstrip('.')}. It was read (in part) before this was found, so the model, optimizer and "
        "other objects may now hold its contents: load another checkpoint before training on."
    )


def _number(storage: CheckpointStorage, location: Location) -> int:
    """``i`` of an automatically named ``checkpoint_{i}``."""
    match = layout._AUTOMATIC_NAME.match(storage.name(location))
    assert match is not None, location  # only automatically named checkpoints are chosen without a folder
    return int(match.group(1))
