"""``Accelerator.prepare_*``: turning the user's objects into prepared ones and registering them.

Models go to the backend (placement, precision, compile, distributed wrapper), optimizers are adapted by
the backend and wrapped so that they step only on synchronised gradients, schedulers follow their
optimizers, dataloaders are sharded. Every prepared object is recorded in :class:`PreparedObjects`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from lockstep.accelerator.optimizer import AcceleratedOptimizer
from lockstep.accelerator.prepared import PreparedObjects
from lockstep.accelerator.scheduler import AcceleratedScheduler
from lockstep.accelerator.settings import AcceleratorSettings
from lockstep.backends.base import Backend
from lockstep.backends.capabilities import JointlyPrepared, JointPreparation, StepDataAssignment
from lockstep.data import prepare_data_loader
from lockstep.integrations.peft import check_adapters_not_added_after_prepare
from lockstep.integrations.quantized import keep_4bit_layout
from lockstep.integrations.transformers_distributed import check_not_sharded_by_transformers
from lockstep.layers.long_context import keep_documents_apart
from lockstep.state import PartialState
from lockstep.step_hooks import StepHooks

_LRScheduler = torch.optim.lr_scheduler.LRScheduler


def models_first(objects: Sequence[Any]) -> list[int]:
    """The positions of ``objects`` in the order they are prepared: models first (a sharding backend
    re-binds optimizers to their parameters), then the rest in the given order."""
    return sorted(range(len(objects)), key=lambda i: not isinstance(objects[i], nn.Module))


def is_unprepared_scheduler(obj: Any) -> bool:
    """An LR scheduler not prepared yet (schedulers are prepared last: they need the prepared optimizers)."""
    return isinstance(obj, _LRScheduler) and not isinstance(obj, AcceleratedScheduler)


def has_device_map(model: nn.Module) -> bool:
    """Whether ``model`` or a submodule was dispatched over several devices (an ``hf_device_map``, as
    transformers' ``from_pretrained(device_map="auto")`` leaves, with more than one entry)."""
    return any(len(getattr(module, "hf_device_map", None) or {}) > 1 for module in model.modules())


def _check_trainable_here(model: nn.Module, state: PartialState) -> None:
    check_not_sharded_by_transformers(model)
    if has_device_map(model) and not state.is_plain:
        raise ValueError(
            f"Cannot prepare {type(model).__name__} for {state.distributed_type} training on "
            f"{state.num_processes} process(es): it was loaded with a device_map (e.g. device_map='auto') that "
            "spreads it over several devices. Train it in one process without a distributed plugin "
            "(python script.py), or load it on one device and let prepare() distribute it."
        )


def _dispatches(data_loader: DataLoader, config: Any, put_on_device: bool) -> bool:
    """Whether ``prepare_data_loader`` would read on the main process and send each process its slice."""
    if config.dispatch_batches is not None:
        return bool(config.dispatch_batches)
    return put_on_device and isinstance(data_loader.dataset, torch.utils.data.IterableDataset)


def _reject_lomo(optimizer: torch.optim.Optimizer) -> None:
    if type(optimizer).__module__.split(".")[0] == "lomo_optim":
        raise NotImplementedError(
            f"Cannot prepare {type(optimizer).__name__}: LOMO optimizers (lomo-optim) update the weights inside "
            "backward, which lockstep does not support. Use a torch.optim optimizer."
        )


class Preparer:
    """Prepares objects for one Accelerator.

    Args:
        backend: how models and optimizers are distributed.
        prepared: where prepared objects are recorded.
        settings: the resolved Accelerator settings (dataloader configuration, RNG types).
        state: the process state.
        device_placement: the Accelerator's default for moving objects to the device.
        step_scheduler_with_optimizer: prepared schedulers follow the optimizer (see ``lockstep.scheduler``).
        step_hooks: the Accelerator's step hooks, given to every prepared optimizer and dataloader.
    """

    def __init__(
        self,
        *,
        backend: Backend,
        prepared: PreparedObjects,
        settings: AcceleratorSettings,
        state: PartialState,
        device_placement: bool,
        step_scheduler_with_optimizer: bool,
        step_hooks: StepHooks,
    ) -> None:
        self.backend = backend
        self.prepared = prepared
        self.settings = settings
        self.state = state
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.step_hooks = step_hooks

    def _placement(self, override: bool | None) -> bool:
        return self.device_placement if override is None else override

    @staticmethod
    def placements(count: int, device_placement: Sequence[bool | None] | None) -> list[bool | None]:
        """One device-placement override per object given to ``prepare`` (None: the default)."""
        placements = list(device_placement) if device_placement is not None else [None] * count
        if len(placements) != count:
            raise ValueError(
                f"prepare() got {count} objects but device_placement has {len(placements)} entries; "
                "give one entry per object."
            )
        return placements

    def model(
        self, model: nn.Module, device_placement: bool | None, evaluation_mode: bool = False
    ) -> nn.Module:
        """The backend's prepared model (the same object when it was prepared already)."""
        if self.prepared.has_model(model):
            return model
        unwrap = self.backend.unwrap_model
        if any(model is unwrap(prepared) for prepared in self.prepared.models):
            raise RuntimeError(
                f"{type(model).__name__} was prepared already; use the object prepare() returned the first time."
            )
        check_adapters_not_added_after_prepare(model, self.prepared.models)
        _check_trainable_here(model, self.state)
        keep_4bit_layout(model)
        # A dispatched model stays where its device map put it (as in Accelerate).
        placement = self._placement(device_placement) and not has_device_map(model)
        if not evaluation_mode:  # a layer's change before the backend distributes it (expert parallelism)
            model = self.step_hooks.preparing_model(model)
        keep_documents_apart(model)  # packed batches: a block-causal mask (no change for unpacked ones)
        prepared = self.backend.prepare_model(
            model, device_placement=placement, evaluation_mode=evaluation_mode
        )
        self.prepared.models.append(prepared)
        if not evaluation_mode:
            self.step_hooks.prepared_model(prepared)
        return prepared

    def optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None
    ) -> AcceleratedOptimizer:
        """An optimizer that steps only on synchronised, non-overflowing gradients."""
        if isinstance(optimizer, AcceleratedOptimizer):
            return optimizer
        _reject_lomo(optimizer)
        inner = self.backend.prepare_optimizer(optimizer)
        self.step_hooks.prepared_optimizer(inner)
        prepared = AcceleratedOptimizer(
            inner,
            self._placement(device_placement),
            scaler=self.backend.precision.scaler,
            device=self.state.device,
            step_hooks=self.step_hooks,
        )
        return self._register_optimizer(prepared)

    def scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """A scheduler that follows the prepared optimizers it drives."""
        if isinstance(scheduler, AcceleratedScheduler):
            return scheduler
        prepared = AcceleratedScheduler(
            scheduler,
            self.prepared.optimizers_of(scheduler),
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.settings.dataloader_config.split_batches,
            num_processes=self.state.num_processes,
        )
        self.prepared.schedulers.append(prepared)
        return prepared

    def together(self, objects: Sequence[Any]) -> dict[int, Any]:
        """The objects the backend prepares together (DeepSpeed's engine with its optimizer and scheduler),
        registered, by position in ``objects``; empty when the backend prepares each on its own."""
        preparation = self.backend.capability(JointPreparation)
        if preparation is None:
            return {}
        joint = preparation.prepare_together(
            objects,
            accumulation_steps=self.settings.gradient_accumulation_plugin.num_steps,
            split_batches=self.settings.dataloader_config.split_batches,
        )
        if joint is None:
            return {}
        index, model = joint.model
        self.prepared.models.append(model)
        result: dict[int, Any] = {index: model}
        optimizer: AcceleratedOptimizer | None = None
        if joint.optimizer is not None:
            index, inner = joint.optimizer
            optimizer = self._register_optimizer(self._engine_optimizer(inner, joint))
            result[index] = optimizer
        if joint.scheduler is not None:
            index, inner = joint.scheduler
            result[index] = self._register_scheduler(inner, [optimizer] if optimizer else [], joint)
        return result

    def _engine_optimizer(self, inner: Any, joint: JointlyPrepared) -> AcceleratedOptimizer:
        if joint.optimizer_stepped_by_model:
            from lockstep.accelerator.engine_stepped import DeepSpeedOptimizerWrapper

            return DeepSpeedOptimizerWrapper(inner, step_hooks=self.step_hooks)
        return AcceleratedOptimizer(inner, False, device=self.state.device, step_hooks=self.step_hooks)

    def _register_optimizer(self, prepared: AcceleratedOptimizer) -> AcceleratedOptimizer:
        self.prepared.optimizers.append(prepared)
        return prepared

    def _register_scheduler(
        self, inner: Any, optimizers: list[Any], joint: JointlyPrepared
    ) -> AcceleratedScheduler:
        kind = AcceleratedScheduler
        if joint.scheduler_stepped_by_model:
            from lockstep.accelerator.engine_stepped import DeepSpeedSchedulerWrapper

            kind = DeepSpeedSchedulerWrapper
        prepared = kind(
            inner,
            optimizers,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.settings.dataloader_config.split_batches,
            num_processes=self.state.num_processes,
        )
        self.prepared.schedulers.append(prepared)
        return prepared

    def data_loader(self, data_loader: DataLoader, device_placement: bool | None) -> DataLoader:
        """A loader sharded across processes whose batches arrive on the device."""
        if self.prepared.has_dataloader(data_loader):
            return data_loader
        config = self.settings.dataloader_config
        assignment = self.backend.capability(StepDataAssignment) or self.step_hooks.capability(
            StepDataAssignment
        )
        if assignment is not None:  # fault tolerance: each step's batches over that step's replicas
            device = self.state.device if self._placement(device_placement) else None
            prepared = assignment.prepare_data_loader(data_loader, device=device, config=config)
            self.prepared.add_dataloader(prepared)
            return prepared
        shard = self.backend.data_shard()
        if shard.count != self.state.num_processes and _dispatches(
            data_loader, config, self._placement(device_placement)
        ):
            raise NotImplementedError(
                "dispatch_batches=True with tensor or context parallelism is not built yet: the main process "
                f"would send {self.state.num_processes} slices where {shard.count} data-parallel replicas need "
                "batches. Pass Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=False))."
            )
        prepared = prepare_data_loader(
            data_loader,
            device=self.state.device,
            num_processes=shard.count,
            process_index=shard.index,
            split_batches=config.split_batches,
            put_on_device=self._placement(device_placement) and shard.place_batches,
            rng_types=[r.value for r in self.settings.rng_types],
            dispatch_batches=config.dispatch_batches,
            even_batches=config.even_batches,
            use_seedable_sampler=config.use_seedable_sampler,
            data_seed=config.data_seed,
            non_blocking=config.non_blocking,
            use_stateful_dataloader=config.use_stateful_dataloader,
            step_hooks=self.step_hooks,
        )
        self.prepared.add_dataloader(prepared)
        return prepared
