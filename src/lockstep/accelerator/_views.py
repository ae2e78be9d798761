"""The Accelerator's read-only views: who this process is, the resolved settings, accumulation state.

A base class of :class:`lockstep.Accelerator` (kept apart so that the facade stays small); every property
reads the process state, the resolved settings or the gradient state that ``Accelerator.__init__`` built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lockstep.accelerator import settings as setup
from lockstep.config.enums import DistributedType
from lockstep.config.project import ProjectConfiguration

if TYPE_CHECKING:
    from lockstep.accelerator.optimizer import AcceleratedOptimizer
    from lockstep.accelerator.settings import AcceleratorSettings
    from lockstep.backends.base import Backend
    from lockstep.precision import Precision
    from lockstep.state import AcceleratorState, GradientState


class AcceleratorViews:
    """Properties of the Accelerator that only read state."""

    state: AcceleratorState
    settings: AcceleratorSettings
    backend: Backend
    precision: Precision
    gradient_state: GradientState
    _optimizers: list[AcceleratedOptimizer]

    # -- who am I ---------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def distributed_type(self) -> DistributedType:
        return self.backend.distributed_type

    @property
    def fsdp_plugin(self) -> Any:
        """The FSDP settings in force (a ``FullyShardedDataParallelPlugin``, whether passed to the constructor
        or chosen by the launcher's config), or None when the model is not sharded with FSDP."""
        return self.settings.fsdp_plugin

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.state.is_last_process

    @property
    def use_distributed(self) -> bool:
        return self.state.use_distributed

    @property
    def mixed_precision(self) -> str:
        return self.settings.mixed_precision.value

    @property
    def native_amp(self) -> bool:
        return self.precision.enabled

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.precision.scaler

    @property
    def project_configuration(self) -> ProjectConfiguration:
        return self.settings.project_config

    @property
    def project_dir(self) -> str | None:
        return self.settings.project_config.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.settings.project_config.logging_dir

    @property
    def save_iteration(self) -> int:
        return self.settings.project_config.iteration

    @property
    def split_batches(self) -> bool:
        return self.settings.dataloader_config.split_batches

    @property
    def dispatch_batches(self) -> bool | None:
        return self.settings.dataloader_config.dispatch_batches

    @property
    def even_batches(self) -> bool:
        return self.settings.dataloader_config.even_batches

    @property
    def use_seedable_sampler(self) -> bool:
        return self.settings.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        return self.settings.dataloader_config.non_blocking

    @property
    def rng_types(self) -> list[str]:
        return [r.value for r in self.settings.rng_types]

    # -- gradient accumulation state --------------------------------------------------------------
    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        setup.resolve_accumulation(steps, None, {})
        self.gradient_state.plugin_kwargs["num_steps"] = steps

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, sync_gradients: bool) -> None:
        self.gradient_state._set_sync_gradients(sync_gradients)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether any prepared optimizer skipped its last step (fp16 overflow)."""
        return any(optimizer.step_was_skipped for optimizer in self._optimizers)
