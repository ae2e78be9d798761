"""The Accelerator's checkpoint methods: which objects, which folder, which hooks.

The file formats and the crash-consistent protocol live in :mod:`lockstep.checkpoint`; this module
decides what to save (everything the Accelerator prepared plus registered objects) and where
(``project_dir/checkpoints/checkpoint_{i}`` with automatic naming).
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.utils.hooks import RemovableHandle

from lockstep.checkpoint import layout
from lockstep.checkpoint.async_writer import AsyncCheckpointWriter
from lockstep.checkpoint.model_files import save_model_files
from lockstep.checkpoint.saver import choose_checkpoint, load_checkpoint, save_checkpoint
from lockstep.checkpoint.training_state import TrainingObjects

if TYPE_CHECKING:
    from torch import nn

    from lockstep.accelerator import Accelerator

CHECKPOINTS_FOLDER = "checkpoints"
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


class Checkpointing:
    """Registered objects and hooks, and the save/load logic of one Accelerator."""

    def __init__(self) -> None:
        self.custom_objects: list[Any] = []
        # OrderedDicts: torch's RemovableHandle keeps a weak reference to the dict.
        self.save_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self.load_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self.writer = AsyncCheckpointWriter()
        self.last_save: SaveReport | None = None

    def register(self, objects: tuple[Any, ...]) -> None:
        invalid = [
            f"item {index} ({type(obj).__name__})"
            for index, obj in enumerate(objects)
            if not (
                callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
            )
        ]
        if invalid:
            raise ValueError(
                f"register_for_checkpointing() accepts only objects with state_dict() and load_state_dict(); "
                f"{', '.join(invalid)} {'has' if len(invalid) == 1 else 'have'} none. Wrap them in a class that "
                "provides both."
            )
        self.custom_objects.extend(objects)

    def add_hook(self, hooks: dict[int, Callable[..., Any]], hook: Callable[..., Any]) -> RemovableHandle:
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    # -- where ------------------------------------------------------------------------------------
    @staticmethod
    def automatic_root(accelerator: Accelerator) -> Path | None:
        config = accelerator.project_configuration
        if config.project_dir is None:
            return None
        return Path(config.project_dir) / CHECKPOINTS_FOLDER

    def save_target(
        self, accelerator: Accelerator, output_dir: str | os.PathLike | None
    ) -> tuple[Path, bool]:
        """(folder, whether it is automatically named)."""
        config = accelerator.project_configuration
        if config.automatic_checkpoint_naming:
            root = self.automatic_root(accelerator)
            if root is None:
                raise ValueError(
                    "ProjectConfiguration(automatic_checkpoint_naming=True) needs a project_dir: pass "
                    "Accelerator(project_dir=...)."
                )
            return root / f"checkpoint_{config.iteration}", True
        if output_dir is None:
            raise ValueError(
                "save_state() needs output_dir=, or ProjectConfiguration(automatic_checkpoint_naming=True) with a "
                "project_dir to name checkpoints project_dir/checkpoints/checkpoint_{i}."
            )
        return Path(output_dir), False

    # -- what -------------------------------------------------------------------------------------
    def objects(self, accelerator: Accelerator) -> TrainingObjects:
        return TrainingObjects(
            models=list(accelerator._models),
            unwrap=lambda model: accelerator.unwrap_model(model, keep_torch_compile=False),
            optimizers=list(accelerator._optimizers),
            schedulers=list(accelerator._schedulers),
            dataloaders=list(accelerator._dataloaders),
            scaler=accelerator.scaler,
            custom=list(self.custom_objects),
            counters={"step": accelerator.step, "iteration": accelerator.project_configuration.iteration},
            sharded=accelerator.backend.sharded_objects(),
        )

    # -- save and load ----------------------------------------------------------------------------
    def save_state(
        self, accelerator: Accelerator, output_dir: Any, safe_serialization: bool, async_save: bool = False
    ) -> str:
        started = time.monotonic()
        folder, automatic = self.save_target(accelerator, output_dir)
        objects = self.objects(accelerator)
        in_shards = (
            objects.sharded_model_indices()
            if objects.sharded and objects.sharded.sharded_state_dict
            else set()
        )
        if objects.sharded is not None and not accelerator.sync_gradients:
            logger.warning(
                "save_state in the middle of a gradient accumulation cycle with FSDP: the gradients of the "
                "micro-batches so far live inside FSDP and are not saved; save after an optimizer step."
            )
        weights: list[Any] = [
            None if i in in_shards else accelerator.get_state_dict(model)
            for i, model in enumerate(objects.models)
        ]
        models: list[nn.Module] = list(objects.models)
        for hook in self.save_hooks.values():
            hook(models, weights, str(folder))
        # A hook may take models out of `weights` (it saved them itself): keep the remaining ones in place.
        kept = [weights[i] if i < len(weights) else None for i in range(len(objects.models))]
        config = accelerator.project_configuration
        writes_shared = accelerator.is_main_process or (
            config.save_on_each_node and accelerator.is_local_main_process
        )
        limit = config.total_limit
        nbytes = save_checkpoint(
            objects,
            folder,
            state=accelerator.state,
            weights=kept,
            writes_shared_files=writes_shared,
            move_latest_pointer=automatic,
            step=accelerator.step,
            safe_serialization=safe_serialization,
            writer=self.writer if async_save else None,
            after_commit=(lambda: layout.rotate(folder.parent, limit))
            if automatic and writes_shared
            else None,
        )
        if automatic:
            config.iteration += 1
        stall = time.monotonic() - started
        self.last_save = SaveReport(
            folder=str(folder), stall_seconds=stall, nbytes=nbytes, asynchronous=async_save
        )
        logger.info(
            "checkpoint %s: training stalled %.3f s (%d bytes, %s)",
            folder,
            stall,
            nbytes,
            "written in the background" if async_save else "written",
        )
        return str(folder)

    def wait(self) -> None:
        """Wait for a background save to be committed (raises its error, if any)."""
        self.writer.wait()

    def load_state(self, accelerator: Accelerator, input_dir: Any) -> None:
        self.wait()
        accelerator.wait_for_everyone()  # every rank's background save is committed before choosing
        root = self.automatic_root(accelerator)
        folder = choose_checkpoint(accelerator.state, None if input_dir is None else Path(input_dir), root)
        objects = self.objects(accelerator)
        models: list[nn.Module] = list(objects.models)
        for hook in self.load_hooks.values():
            hook(models, str(folder))
        to_load = [i for i, model in enumerate(objects.models) if any(model is m for m in models)]
        counters, _ = load_checkpoint(objects, folder, state=accelerator.state, models_to_load=to_load)
        accelerator.step = int(counters.get("step", 0))
        match = layout._AUTOMATIC_NAME.match(folder.name)
        if accelerator.project_configuration.automatic_checkpoint_naming and match:
            accelerator.project_configuration.iteration = int(match.group(1)) + 1


def save_model(
    accelerator: Accelerator,
    model: nn.Module,
    save_directory: Any,
    max_shard_size: int | str,
    safe_serialization: bool,
) -> None:
    """Write the unwrapped model's weights as (sharded) safetensors on the main process."""
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        save_model_files(
            state_dict, save_directory, max_shard_size=max_shard_size, safe_serialization=safe_serialization
        )
    accelerator.wait_for_everyone()
