"""The Accelerator's checkpoint members (Accelerate's names): ``save_state``, ``load_state``, the save/load
hooks, ``register_for_checkpointing``, ``save_model`` and ``save``, over a :class:`CheckpointManager` built
on first use (so that ``from lockstep import Accelerator`` does not import :mod:`lockstep.checkpoint`)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from lockstep.accelerator.accumulation import GradientAccumulation
    from lockstep.accelerator.checkpoints import CheckpointManager, SaveReport
    from lockstep.accelerator.prepared import PreparedObjects
    from lockstep.backends.base import Backend
    from lockstep.config.project import ProjectConfiguration
    from lockstep.state import PartialState


class CheckpointingView:
    """Saving and loading the whole training state, and the model alone.

    Args:
        prepared: the prepared objects (what a checkpoint holds) and the registered ones.
        backend: writes and reads the model and optimizer state.
        state: the process state.
        project: the project folder and checkpoint naming.
        accumulation: where the loop stands in an accumulation cycle (saved with the state).
        step_timer: counts the time spent checkpointing.
        keep_global_batch: ``Accelerator(elastic_keep_global_batch=...)``.
        record_event: writes a text event to the run's trackers (the restart line of a resized load).
        live_recovery: the live recovery of this run (fault tolerance's layer), or None, asked at each save
            and load.
    """

    def __init__(
        self,
        *,
        prepared: PreparedObjects,
        backend: Backend,
        state: PartialState,
        project: ProjectConfiguration,
        accumulation: GradientAccumulation,
        step_timer: Any,
        keep_global_batch: bool = False,
        record_event: Callable[[str, int | None], None] | None = None,
        live_recovery: Callable[[], Any] = lambda: None,
    ) -> None:
        self._live_recovery = live_recovery
        self._keep_global_batch = keep_global_batch
        self._record_event = record_event
        self._prepared = prepared
        self._backend = backend
        self._state = state
        self._project = project
        self._accumulation = accumulation
        self._step_timer = step_timer
        self._manager: CheckpointManager | None = None
        if not _stays_local(project.project_dir):
            self.manager  # noqa: B018 -- an object store is checked now, before training, not at the first save

    @property
    def manager(self) -> CheckpointManager:
        """The checkpoint manager (built, and :mod:`lockstep.checkpoint` imported, on first use)."""
        if self._manager is None:
            from lockstep.accelerator.checkpoints import CheckpointManager

            self._manager = CheckpointManager(
                prepared=self._prepared,
                backend=self._backend,
                state=self._state,
                project=self._project,
                accumulation=self._accumulation,
                keep_global_batch=self._keep_global_batch,
                record_event=self._record_event,
                live_recovery=self._live_recovery,
            )
        return self._manager

    def started_manager(self) -> CheckpointManager | None:
        """The checkpoint manager once a checkpoint was saved or loaded (None before: no background save)."""
        return self._manager

    def wait_if_started(self) -> None:
        """Wait for a background save, if a checkpoint was ever saved (at the end of training)."""
        if self._manager is not None:
            self._manager.wait()

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """Save ``obj`` once per machine set-up (on the main process): torch.save or safetensors."""
        if not self._state.is_main_process:
            return
        if safe_serialization:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in obj.items()}, f)
        else:
            torch.save(obj, f)

    def save_state(
        self,
        output_dir: str | None = None,
        safe_serialization: bool = True,
        async_save: bool = False,
        durable: str = "background",
        **kwargs: Any,
    ) -> str:
        """``Accelerator.save_state``: the crash-consistent checkpoint of everything prepared (see there)."""
        _refuse_model_kwargs("save_state", "save_model_func_kwargs", kwargs)
        checkpoints = self.manager  # built (and its modules imported) before the save is timed
        each_node = self._project.save_on_each_node
        output_dir = _main_process_folder(self._state, output_dir, "save_state", each_node=each_node)
        with self._step_timer.checkpoint():
            return checkpoints.save_state(output_dir, safe_serialization, async_save, durable)

    def wait_for_checkpoint(self) -> None:
        """``Accelerator.wait_for_checkpoint``: wait for the background save (see there)."""
        with self._step_timer.checkpoint():
            self.manager.wait()

    @property
    def last_save_report(self) -> SaveReport | None:
        """Folder, training stall in seconds, bytes and mode of the last ``save_state`` (None before one)."""
        return None if self._manager is None else self._manager.last_save

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> None:
        """``Accelerator.load_state``: restore a checkpoint written by ``save_state`` (see there)."""
        _refuse_model_kwargs("load_state", "load_kwargs / load_model_func_kwargs", kwargs)
        each_node = self._project.save_on_each_node
        self.manager.load_state(
            _main_process_folder(self._state, input_dir, "load_state", each_node=each_node)
        )

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and load these objects (anything with ``state_dict``/``load_state_dict``) with the state."""
        self._prepared.register_for_checkpointing(objects)

    def register_save_state_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """``Accelerator.register_save_state_pre_hook``: a hook called before each save (see there)."""
        return self.manager.add_hook(self.manager.save_hooks, hook)

    def register_load_state_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """Call ``hook(models, input_dir)`` before loading; it may pop models it loaded itself."""
        return self.manager.add_hook(self.manager.load_hooks, hook)

    def save_model(
        self,
        model: nn.Module,
        save_directory: str,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """``Accelerator.save_model``: the unwrapped model as (sharded) safetensors (see there)."""
        self.manager.save_model(model, save_directory, max_shard_size, safe_serialization)


def _stays_local(project_dir: Any) -> bool:
    """Whether ``project_dir`` is unset or a folder its storage writes in place: nothing to check before
    training. A storage that cannot be built is not: the checkpoint manager raises that, on every process
    together."""
    if project_dir is None:
        return True
    from lockstep.checkpoint.storage import storage_for

    try:
        return storage_for(project_dir).local
    except (ImportError, ValueError, OSError):
        return False


def _main_process_folder(state: PartialState, folder: Any, method: str, *, each_node: bool = False) -> Any:
    """``folder`` as the main process named it, on every rank (one small collective; as given on one process);
    with ``each_node`` (``ProjectConfiguration(save_on_each_node=True)``: node-local disks, where each node's
    folder may have another path), as the main process of this node named it.

    A checkpoint is one folder: every rank writes its files into the staging folder the main process creates,
    and ``load_state`` reads the folder the main process names. Accelerate lets each process pass a folder of
    its own (its tests give every rank a ``tempfile.TemporaryDirectory()``), where lockstep's save failed on the
    other ranks (their staging folder did not exist). A process that named another folder now warns and uses
    the main process's.
    """
    if folder is None or not state.use_distributed:
        return folder
    from lockstep.collectives import broadcast_object_list, gather_object

    if each_node:  # ranks are contiguous per node: this node's main process is its first rank
        named = [gather_object([os.fspath(folder)])[state.process_index - state.local_process_index]]
        main = f"the main process of its node (process {state.process_index - state.local_process_index})"
    else:
        named = [os.fspath(folder)]
        broadcast_object_list(named, from_process=0)
        main = "the main process"
    if named[0] == os.fspath(folder):
        return folder
    warnings.warn(
        f"{method}({os.fspath(folder)!r}) on process {state.process_index} of {state.num_processes}, where {main} "
        f"passed {named[0]!r}: a checkpoint is one folder, the main process's (every process writes its files "
        "there, and load_state reads the folder the main process names), so that one is used. Pass every "
        "process the same folder.",
        UserWarning,
        stacklevel=3,
    )
    return named[0]


def _refuse_model_kwargs(method: str, accelerate_name: str, kwargs: dict[str, Any]) -> None:
    """Accelerate passes these keyword arguments on to its model savers and loaders; lockstep's backends save
    and load the model themselves, so they are refused rather than ignored."""
    if kwargs:
        raise NotImplementedError(
            f"Accelerator.{method}({', '.join(f'{key}=...' for key in kwargs)}) is not supported: lockstep's "
            f"backends save and load the model themselves and take no extra keyword arguments (Accelerate's "
            f"{accelerate_name}). Remove them."
        )
