"""The Accelerator's resolved settings, read back under Accelerate's attribute names.

A base of :class:`lockstep.Accelerator` that stands on its own: it needs only the resolved settings
(:func:`~lockstep.accelerator.settings.resolve_settings`), and every member reads them.

Example:
    >>> from lockstep.accelerator.settings import resolve_settings
    >>> from lockstep.config.kwargs import ProfileKwargs
    >>> view = SettingsView(resolve_settings(
    ...     mixed_precision="bf16", gradient_accumulation_steps=None, gradient_accumulation_plugin=None,
    ...     dataloader_config=None, project_dir=None, project_config=None, dynamo_backend=None,
    ...     dynamo_plugin=None, rng_types=None, kwargs_handlers=[ProfileKwargs(record_shapes=True)]))
    >>> view.mixed_precision, view.use_stateful_dataloader, view.profile_handler.record_shapes
    ('bf16', False, True)
"""

from __future__ import annotations

from typing import Any

from lockstep.accelerator.settings import AcceleratorSettings, resolve_rng_types
from lockstep.config.dataloader import DataLoaderConfiguration
from lockstep.config.kwargs import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)
from lockstep.config.project import ProjectConfiguration


class SettingsView:
    """Mixed precision, folders, dataloader configuration, RNG types, FSDP plugin and ``kwargs_handlers``.

    Args:
        settings: the resolved constructor settings.
    """

    def __init__(self, settings: AcceleratorSettings) -> None:
        self.settings = settings

    # -- precision, folders, plugins --------------------------------------------------------------
    @property
    def mixed_precision(self) -> str:
        return self.settings.mixed_precision.value

    @property
    def fsdp_plugin(self) -> Any:
        """``Accelerator.fsdp_plugin``: the FSDP settings in force, or None (see there)."""
        return self.settings.fsdp_plugin

    @property
    def deepspeed_config(self) -> dict[str, Any]:
        """``Accelerator.deepspeed_config``: the active DeepSpeed config (see there)."""
        plugins = self.settings.deepspeed_plugins
        if not plugins:
            raise AttributeError(
                "'Accelerator' has no attribute 'deepspeed_config': DeepSpeed is not in use."
            )
        active = next((p for p in plugins.values() if p.selected), next(iter(plugins.values())))
        return active.deepspeed_config

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
    def rng_types(self) -> list[str]:
        return [r.value for r in self.settings.rng_types]

    # -- dataloaders ------------------------------------------------------------------------------
    @property
    def dataloader_config(self) -> DataLoaderConfiguration:
        """``Accelerator.dataloader_config``: the loaders' configuration in force (see there)."""
        return self.settings.dataloader_config

    @dataloader_config.setter
    def dataloader_config(self, config: DataLoaderConfiguration) -> None:
        if not isinstance(config, DataLoaderConfiguration):
            raise TypeError(
                f"accelerator.dataloader_config = {config!r} is invalid: it must be a DataLoaderConfiguration, "
                f"got {type(config).__name__}. Pass DataLoaderConfiguration(...)."
            )
        settings = self.settings
        if settings.rng_types == resolve_rng_types(None, settings.dataloader_config):
            # rng_types were the default, which follows use_seedable_sampler: follow the new configuration
            settings.rng_types = resolve_rng_types(None, config)
        settings.dataloader_config = config

    @property
    def split_batches(self) -> bool:
        return self.settings.dataloader_config.split_batches

    @property
    def dispatch_batches(self) -> bool | None:
        return self.settings.dataloader_config.dispatch_batches

    @property
    def even_batches(self) -> bool:
        return self.settings.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, even_batches: bool) -> None:
        """Loaders prepared from now on fill (True) or do not fill (False) the short last batch."""
        self.settings.dataloader_config.even_batches = even_batches

    @property
    def use_seedable_sampler(self) -> bool:
        return self.settings.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        return self.settings.dataloader_config.non_blocking

    @property
    def use_stateful_dataloader(self) -> bool:
        """``Accelerator.use_stateful_dataloader``: whether loaders are stateful (see there)."""
        return self.settings.dataloader_config.use_stateful_dataloader

    # -- kwargs_handlers, as Accelerate's attributes ----------------------------------------------
    @property
    def ddp_handler(self) -> DistributedDataParallelKwargs | None:
        """The ``DistributedDataParallelKwargs`` given in ``kwargs_handlers`` (None when none was)."""
        return self.settings.handlers.ddp

    @property
    def scaler_handler(self) -> GradScalerKwargs | None:
        """The ``GradScalerKwargs`` given in ``kwargs_handlers`` (None when none was)."""
        return self.settings.handlers.scaler

    @property
    def init_handler(self) -> InitProcessGroupKwargs | None:
        """The ``InitProcessGroupKwargs`` given in ``kwargs_handlers`` (None when none was)."""
        return self.settings.handlers.init

    @property
    def autocast_handler(self) -> AutocastKwargs | None:
        """The ``AutocastKwargs`` given in ``kwargs_handlers`` (None when none was)."""
        return self.settings.handlers.autocast

    @property
    def profile_handler(self) -> ProfileKwargs | None:
        """The ``ProfileKwargs`` given in ``kwargs_handlers``, used by ``profile()`` (None when none was)."""
        return self.settings.handlers.profile
