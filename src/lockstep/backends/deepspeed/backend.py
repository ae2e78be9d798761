"""The DeepSpeed backend: ZeRO stages 0-3 on the real ``deepspeed`` engine, on lockstep's process group.

``prepare`` hands the model, its optimizer and its scheduler to :meth:`DeepSpeedBackend.prepare_together`,
which fills the config's ``"auto"`` values (:mod:`.auto`) and builds one engine with ``deepspeed.initialize``.
The engine is the prepared model; the optimizer and scheduler the user holds are wrappers whose ``step`` is
the engine's (it steps in :meth:`DeepSpeedBackend.backward` on the last micro-batch of an accumulation
cycle). Checkpoints are the engine's own files (:mod:`.checkpoint`), inside lockstep's staging folder.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any, final

import torch
from torch import nn

from lockstep.backends.base import Backend, Indexed
from lockstep.backends.capabilities import (
    ConfiguredOptimizer,
    GatheredForward,
    JointlyPrepared,
    JointPreparation,
    ShardedCheckpointIO,
)
from lockstep.backends.deepspeed import auto, checkpoint, trainer_options, universal
from lockstep.backends.deepspeed.loading import check_fp16_supported, import_deepspeed
from lockstep.backends.deepspeed.placeholders import DummyOptim, DummyScheduler
from lockstep.backends.deepspeed.plugin import DeepSpeedPlugin
from lockstep.checkpoint.collective_save import agree
from lockstep.config.enums import DistributedType, PrecisionType
from lockstep.config.plugins import TorchDynamoPlugin
from lockstep.precision import Precision
from lockstep.state import GradientState, PartialState

_LRScheduler = torch.optim.lr_scheduler.LRScheduler


@final
class DeepSpeedBackend(Backend, JointPreparation, ShardedCheckpointIO, GatheredForward, ConfiguredOptimizer):
    """ZeRO through DeepSpeed engines, one per ``prepare`` call that holds a model.

    Args:
        state: the process state.
        plugins: the named plugins; the selected one configures the next engine.
        mixed_precision: the Accelerator's setting; it switches the config's fp16/bf16 section on.
        dynamo_plugin: ``torch.compile`` settings (applied with ``engine.compile``).
    """

    distributed_type = DistributedType.DEEPSPEED

    def __init__(
        self,
        state: PartialState,
        *,
        plugins: dict[str, DeepSpeedPlugin],
        mixed_precision: PrecisionType = PrecisionType.NO,
        dynamo_plugin: TorchDynamoPlugin | None = None,
    ) -> None:
        # DeepSpeed casts the model and scales the loss itself: lockstep's forward runs as the engine's.
        super().__init__(
            state, precision=Precision(PrecisionType.NO, state.device), dynamo_plugin=dynamo_plugin
        )
        self.plugins = plugins
        self.deepspeed = import_deepspeed(device_type=state.device.type, local_rank=state.local_process_index)
        for plugin in plugins.values():
            plugin.set_mixed_precision(mixed_precision.value)
            if plugin.mixed_precision_of_config() == "fp16":
                check_fp16_supported(self.deepspeed)
        if self.active_plugin.is_zero3_init_enabled():
            self.active_plugin.set_deepspeed_weakref()
        self.engines: list[Any] = []

    @property
    def active_plugin(self) -> DeepSpeedPlugin:
        """The selected plugin (the first one unless ``select_deepspeed_plugin`` chose another)."""
        return next((p for p in self.plugins.values() if p.selected), next(iter(self.plugins.values())))

    def optimizer_and_scheduler(
        self,
        model: nn.Module,
        *,
        learning_rate: float,
        weight_decay: float,
        warmup_steps: int,
        max_steps: int,
        build_optimizer: Callable[[], Any],
        build_scheduler: Callable[[Any], Any],
    ) -> tuple[Any, Any]:
        """The active plugin's config optimizer and scheduler as placeholders, or the caller's own
        (``build_scheduler(optimizer)`` makes the Trainer's schedule on an optimizer)."""
        plugin = self.active_plugin
        if "optimizer" not in plugin.deepspeed_config:
            optimizer = build_optimizer()
            return optimizer, build_scheduler(optimizer)
        optimizer = DummyOptim(model.parameters(), lr=learning_rate, weight_decay=weight_decay)
        if "scheduler" in plugin.deepspeed_config:
            trainer_options.fill_schedule(plugin, warmup_steps=warmup_steps, max_steps=max_steps)
            return optimizer, DummyScheduler(optimizer, warmup_num_steps=warmup_steps)
        return optimizer, DummyScheduler(optimizer, lr_scheduler_callable=build_scheduler)

    # -- parameters gathered in forward (ZeRO-3) -----------------------------------------------------
    def gathers_in_forward(self, model: nn.Module) -> bool:
        """Whether the selected plugin partitions the parameters (ZeRO stage 3): each forward gathers them."""
        return self.active_plugin.zero_stage == 3

    def root_parameters_gathered(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Nothing to do: ZeRO-3 gathers each submodule's parameters in its own forward hooks."""
        return contextlib.nullcontext()

    # -- preparing model, optimizer and scheduler together -------------------------------------------
    def prepare_together(
        self, objects: Sequence[Any], *, accumulation_steps: int, split_batches: bool
    ) -> JointlyPrepared | None:
        """Build one engine from the model, optimizer and scheduler among ``objects``.

        Raises:
            ValueError: more than one model or optimizer, an optimizer without its model, or a config whose
                ``"auto"`` values cannot be filled.
        """
        models = _positions(objects, lambda o: isinstance(o, nn.Module) and not self.is_engine(o))
        optimizers = _positions(
            objects, lambda o: isinstance(o, torch.optim.Optimizer | DummyOptim) and not _is_wrapper(o)
        )
        schedulers = _positions(objects, lambda o: self._is_scheduler(o) and not _is_wrapper(o))
        if not models:
            if optimizers:
                raise ValueError(
                    "Under DeepSpeed an optimizer is prepared together with its model: pass both to one prepare() call."
                )
            return None
        _at_most_one(
            models,
            "models",
            "Prepare each model in its own prepare() call (select_deepspeed_plugin(name) "
            "chooses the plugin of each).",
        )
        _at_most_one(optimizers, "optimizers", "DeepSpeed's engine steps one optimizer.")
        _at_most_one(schedulers, "schedulers", "DeepSpeed's engine steps one scheduler.")
        model = objects[models[0]]
        optimizer = objects[optimizers[0]] if optimizers else None
        scheduler = objects[schedulers[0]] if schedulers else None
        run = auto.TrainingRun(
            batch_sizes=[
                getattr(o, "batch_size", None) for o in objects if isinstance(o, torch.utils.data.DataLoader)
            ],
            accumulation_steps=accumulation_steps,
            num_processes=self.state.num_processes,
            split_batches=split_batches,
        )
        engine, ds_optimizer, ds_scheduler = self._initialize(model, optimizer, scheduler, run)
        return JointlyPrepared(
            model=(models[0], engine),
            optimizer=(optimizers[0], ds_optimizer) if optimizers and ds_optimizer is not None else None,
            scheduler=(schedulers[0], scheduler if ds_scheduler is None else ds_scheduler)
            if schedulers
            else None,
            scheduler_stepped_by_model=ds_scheduler is not None,
            optimizer_stepped_by_model=True,
        )

    def _initialize(
        self, model: nn.Module, optimizer: Any, scheduler: Any, run: auto.TrainingRun
    ) -> tuple[Any, Any, Any]:
        plugin = self.active_plugin
        auto.check_optimizer_and_scheduler(plugin, optimizer, scheduler)
        if torch.optim.Optimizer in type(optimizer).__mro__:
            plugin.deepspeed_config["zero_allow_untested_optimizer"] = True
        plugin.set_moe_leaf_modules(model)
        values = auto.auto_values(plugin, run, model=model, optimizer=optimizer, scheduler=scheduler)
        plugin.deepspeed_config_process(must_match=False, **values)
        kwargs: dict[str, Any] = {"model": model, "config_params": plugin.deepspeed_config}
        if isinstance(optimizer, DummyOptim):
            kwargs["model_parameters"] = optimizer.params
            if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is not None:
                kwargs["lr_scheduler"] = scheduler.lr_scheduler_callable
        elif optimizer is not None:
            kwargs["optimizer"] = self._offloaded(optimizer, plugin)
            if scheduler is not None and type(scheduler).__name__ in self._deepspeed_schedulers():
                kwargs["lr_scheduler"] = scheduler
        self._ensure_process_group()
        engine, ds_optimizer, _, ds_scheduler = self.deepspeed.initialize(**kwargs)
        self._compile(engine)
        self.engines.append(engine)
        return engine, ds_optimizer, ds_scheduler

    def _offloaded(self, optimizer: torch.optim.Optimizer, plugin: DeepSpeedPlugin) -> torch.optim.Optimizer:
        """With the optimizer offloaded to the CPU, DeepSpeed's CPU Adam replaces a torch optimizer (as in
        Accelerate; ``zero_force_ds_cpu_optimizer: false`` keeps the torch one)."""
        device = plugin.get_value("zero_optimization.offload_optimizer.device", "none")
        if device in ("none", None) or not plugin.deepspeed_config.get("zero_force_ds_cpu_optimizer", True):
            return optimizer
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        defaults = {k: v for k, v in optimizer.defaults.items() if k in ("lr", "weight_decay")}
        return DeepSpeedCPUAdam(optimizer.param_groups, **defaults)

    def _deepspeed_schedulers(self) -> Sequence[str]:
        from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES

        return VALID_LR_SCHEDULES

    def _is_scheduler(self, obj: Any) -> bool:
        return (
            isinstance(obj, _LRScheduler | DummyScheduler)
            or type(obj).__name__ in self._deepspeed_schedulers()
        )

    def _ensure_process_group(self) -> None:
        from lockstep import _process_group

        _process_group.init_group_of_one("gloo" if self.device.type == "cpu" else "nccl")

    def _compile(self, engine: Any) -> None:
        plugin = self.dynamo_plugin
        if plugin is None or not plugin.enabled:
            return
        kwargs = plugin.compile_kwargs()
        engine.compile(backend=kwargs.pop("backend"), compile_kwargs=kwargs)

    def is_engine(self, model: Any) -> bool:
        return isinstance(model, self.deepspeed.DeepSpeedEngine)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """A model prepared on its own (``prepare_model``): an engine without an optimizer (inference)."""
        run = auto.TrainingRun(
            batch_sizes=[], accumulation_steps=1, num_processes=self.state.num_processes, split_batches=False
        )
        engine, _, _ = self._initialize(model, None, None, run)
        return engine

    def _prepare_for_training(self, model: nn.Module, *, device_placement: bool) -> nn.Module:
        return self.wrap_model(model)  # the engine places and compiles the model itself

    def unwrap_model(self, model: nn.Module, *, keep_torch_compile: bool = True) -> nn.Module:
        if self.is_engine(model):
            model = model.module
        return super().unwrap_model(model, keep_torch_compile=keep_torch_compile)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's weights; under ZeRO-3 the engine gathers them (16-bit when training in 16 bits),
        which needs ``zero3_save_16bit_model`` (``stage3_gather_16bit_weights_on_model_save``)."""
        engine = self._engine_of(model)
        if engine is None or engine.zero_optimization_stage() != 3:
            return super().full_state_dict(self.unwrap_model(model, keep_torch_compile=False))
        if not engine.zero_gather_16bit_weights_on_model_save():
            raise ValueError(
                "Cannot gather the model's weights under ZeRO-3: the DeepSpeed config's "
                "zero_optimization.stage3_gather_16bit_weights_on_model_save is false. Set it to true (or "
                "DeepSpeedPlugin(zero3_save_16bit_model=True), zero3_save_16bit_model: true in the config file); "
                "or save the full training state with save_state() and merge it with lockstep merge-weights."
            )
        return engine._zero3_consolidated_16bit_state_dict() or {}  # the main process's; {} elsewhere

    def _engine_of(self, model: nn.Module) -> Any:
        if self.is_engine(model):
            return model
        return next((e for e in self.engines if e.module is model), None)

    # -- training step ----------------------------------------------------------------------------
    def scale_for_accumulation(self, loss: torch.Tensor, steps: int) -> torch.Tensor:
        return loss  # the engine divides by its gradient_accumulation_steps itself

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The engine's backward; on the last micro-batch of a cycle (``sync_gradients``), also its step
        (reduce, clip, optimizer and scheduler step, zero the gradients)."""
        engine = self._training_engine()
        sync = GradientState().sync_gradients
        engine.set_gradient_accumulation_boundary(is_boundary=sync)
        engine.backward(loss, **kwargs)
        if sync:
            engine.step()

    def stepping_engine(self) -> Any:
        """The first engine prepared with an optimizer (the one ``backward`` steps), or None before ``prepare``."""
        return next((e for e in self.engines if e.optimizer is not None), None)

    def _training_engine(self) -> Any:
        engine = next((e for e in self.engines if e.optimizer is not None), None)
        if engine is None:
            raise RuntimeError(
                "accelerator.backward() under DeepSpeed needs a model prepared together with its optimizer: pass "
                "the model and the optimizer to one prepare() call."
            )
        return engine

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> Any:
        """The gradient norm the engine computed at its last step (DeepSpeed clips with the config's
        ``gradient_clipping`` itself, as in Accelerate)."""
        engines = [e for e in self.engines if e.optimizer is not None]
        return engines[0].get_global_grad_norm() if engines else None

    # -- checkpoints ---------------------------------------------------------------------------------
    def model_state_dicts(self, models: Sequence[nn.Module]) -> list[dict[str, torch.Tensor] | None]:
        """None for an engine (it writes its own files in :meth:`save_shards`)."""
        return [None if self.is_engine(m) else super().model_state_dicts([m])[0] for m in models]

    def optimizer_states(self, optimizers: Sequence[Any]) -> list[Any]:
        return [None if self._belongs_to_engine(o) else o for o in optimizers]

    def _belongs_to_engine(self, optimizer: Any) -> bool:
        inner = getattr(optimizer, "optimizer", optimizer)
        return any(inner is e.optimizer for e in self.engines)

    def _holds_own_gradients(self, model: nn.Module) -> bool:
        return not self.is_engine(model)

    def pending_gradients(
        self, models: Sequence[nn.Module], *, mid_accumulation: bool
    ) -> dict[str, torch.Tensor]:
        if mid_accumulation and any(self.is_engine(m) for m in models):
            raise ValueError(
                "save_state() in the middle of a DeepSpeed accumulation cycle: the engine holds the accumulated "
                "gradients in its own partitioned buffers, which DeepSpeed does not save. Save after the "
                "optimizer step (when accelerator.sync_gradients is True)."
            )
        return super().pending_gradients(models, mid_accumulation=mid_accumulation)

    def save_shards(
        self, models: Indexed, optimizers: Indexed, folder: Path, *, frozen_left_out: Collection[int] = ()
    ) -> None:
        for index, model in models:
            if self.is_engine(model):
                checkpoint.save_engine(model, folder, index, frozen_left_out=index in frozen_left_out)

    def read_model_states(self, models: Indexed, optimizers: Indexed, folder: Path) -> Any:
        plain = [(i, m) for i, m in models if not self.is_engine(m)]
        own = [(i, o) for i, o in optimizers if not self._belongs_to_engine(o)]
        super().read_model_states(plain, own, folder)
        engines = [(i, m) for i, m in models if self.is_engine(m)]
        for index, _ in engines:
            checkpoint.check_engine_files(folder, index)
        saved_world = checkpoint.saved_world_size(folder) if engines else self.state.num_processes
        return engines, folder, saved_world

    def apply_model_states(self, models: Indexed, optimizers: Indexed, loaded: Any) -> None:
        engines, folder, saved_world = loaded
        for index, engine in engines:
            stage = engine.zero_optimization_stage()
            if stage == 0 or saved_world == self.state.num_processes:
                checkpoint.load_engine(engine, folder, index)
            else:  # DeepSpeed partitions ZeRO 1-3 state by the number of processes: reshard it
                self._load_resharded(engine, folder, index, stage=stage, saved_world=saved_world)

    def _load_resharded(self, engine: Any, folder: Path, index: int, *, stage: int, saved_world: int) -> None:
        """Convert engine ``index``'s files to a universal checkpoint on the main process, then load it on
        every process (:mod:`.universal`)."""
        world = self.state.num_processes
        converted = checkpoint.engine_folder(universal.universal_root(folder), index)
        error = None
        if self.state.is_main_process:
            try:
                universal.convert(folder, index, stage=stage, saved_world=saved_world, world=world)
            except Exception as failure:
                error = failure
        agree(
            self.state,
            error,
            f"Converting the ZeRO-{stage} checkpoint {folder} from {saved_world} to {world} processes",
        )
        universal.load_universal(engine, converted)
        self.state.wait_for_everyone()  # every process has read the copy
        if self.state.is_main_process:
            universal.discard(folder, index)

    def release(self, model: Any) -> None:
        """Destroy an engine that ``free_memory`` drops (its hooks, buffers and process-group handles)."""
        engine = self._engine_of(model) if isinstance(model, nn.Module) else None
        if engine is not None:
            engine.destroy()
            self.engines.remove(engine)


def _positions(objects: Sequence[Any], test: Any) -> list[int]:
    return [index for index, obj in enumerate(objects) if test(obj)]


def _is_wrapper(obj: Any) -> bool:
    """An optimizer or scheduler lockstep prepared already (it holds the inner one)."""
    return type(obj).__module__.startswith("lockstep.accelerator")


def _at_most_one(positions: list[int], what: str, advice: str) -> None:
    if len(positions) > 1:
        raise ValueError(
            f"prepare() was given {len(positions)} {what} (positions {positions}) under DeepSpeed. {advice}"
        )
