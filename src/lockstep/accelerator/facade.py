"""The Accelerator: the facade a training script talks to.

Every method is a few lines that delegate to the part that does the work, each built once in
``__init__`` with exactly what it needs: the resolved settings (:mod:`.settings`), the process state
(:mod:`lockstep.state`), the backend with its precision (:mod:`lockstep.backends.registry`), the registry
of prepared objects (:mod:`.prepared`) filled by the :class:`~.preparation.Preparer`, the accumulation
position (:mod:`.accumulation`), the trackers (:mod:`.trackers`), the step timer
(:mod:`lockstep.throughput`), the checkpoint manager (:mod:`.checkpoints`, built on first use), the
preemption watcher (:mod:`.preemption`) and the profiler (:mod:`.profiling`). Collectives are
:mod:`lockstep.collectives`. Three standalone bases hold members that need one part only: who this process
is (:mod:`.process_view`), the resolved settings (:mod:`.settings_view`) and Accelerate's members for
features not built yet (:mod:`.unconfigured`).

Example:
    >>> from lockstep import Accelerator
    >>> accelerator = Accelerator()
    >>> model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)  # doctest: +SKIP
    >>> for batch in train_dl:  # doctest: +SKIP
    ...     loss = model(**batch).loss
    ...     accelerator.backward(loss)
    ...     optimizer.step()
    ...     optimizer.zero_grad()
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader

from lockstep.accelerator.accumulation import GradientAccumulation
from lockstep.accelerator.checkpointing_view import CheckpointingView
from lockstep.accelerator.collectives_view import CollectivesView
from lockstep.accelerator.live_state import share_live_state
from lockstep.accelerator.mesh_view import MeshView, build_layout
from lockstep.accelerator.optimizer import AcceleratedOptimizer
from lockstep.accelerator.parts import answers_for
from lockstep.accelerator.preemption import DEFAULT_SIGNALS, PreemptionWatcher, exit_now
from lockstep.accelerator.preparation import Preparer, has_device_map, is_unprepared_scheduler, models_first
from lockstep.accelerator.prepared import PreparedObjects
from lockstep.accelerator.process_view import ProcessView
from lockstep.accelerator.scheduler import AcceleratedScheduler
from lockstep.accelerator.settings import (
    NOT_GIVEN,
    apply_deprecated_dataloader_arguments,
    launcher_settings,
    reject_unbuilt_features,
    resolve_accumulation,
    resolve_settings,
)
from lockstep.accelerator.settings_view import SettingsView
from lockstep.accelerator.trackers import Trackers
from lockstep.accelerator.tracking_view import TrackingView
from lockstep.accelerator.unconfigured import UnconfiguredFeatures
from lockstep.backends.capabilities import NO_PIPELINE, C, JointPreparation, PipelineSchedule
from lockstep.backends.registry import select_backend
from lockstep.config.backend_specs import BackendSpec, given_add_ons
from lockstep.config.dataloader import DataLoaderConfiguration
from lockstep.config.enums import DistributedType, PrecisionType
from lockstep.config.kwargs import AutocastKwargs, ProfileKwargs
from lockstep.config.plugins import GradientAccumulationPlugin, TorchDynamoPlugin
from lockstep.config.project import ProjectConfiguration
from lockstep.data import skip_first_batches as _skip_first_batches
from lockstep.memory import release_memory
from lockstep.precision import Precision, remove_forward_wrapper
from lockstep.state import AcceleratorState, GradientState
from lockstep.step_hooks import StepHook, StepHooks
from lockstep.throughput.build import build_step_timer

if TYPE_CHECKING:
    from lockstep.backends.base import Backend

F = TypeVar("F", bound=Callable[..., Any])


@answers_for("_process", ProcessView)
@answers_for("_settings", SettingsView)
@answers_for("_mesh", MeshView)
@answers_for("_tracking", TrackingView)
@answers_for("_unconfigured", UnconfiguredFeatures)
@answers_for("_collectives", CollectivesView)
@answers_for("_saving", CheckpointingView, internal=("manager", "wait_if_started", "started_manager"))
class Accelerator:
    """Runs one ordinary training loop on one CPU, one GPU, many processes or many machines.

    Args:
        device_placement: move prepared models and batches to ``self.device``.
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"`` (default: the launcher's setting, else "no").
        gradient_accumulation_steps: micro-batches per optimizer step, used with ``accumulate()``.
        cpu: train on the CPU even when an accelerator is present.
        dataloader_config: how prepared dataloaders split data (``DataLoaderConfiguration``).
        rng_types: generators synchronised from rank 0 at each epoch start (default ``["generator"]``).
        project_dir: the run's folder; shorthand for ``project_config.project_dir``.
        project_config: a ``ProjectConfiguration``.
        gradient_accumulation_plugin: finer accumulation settings (instead of the steps argument).
        step_scheduler_with_optimizer: prepared schedulers follow the optimizer (see ``lockstep.scheduler``).
        kwargs_handlers: ``DistributedDataParallelKwargs``, ``GradScalerKwargs``, ``InitProcessGroupKwargs``,
            ``AutocastKwargs``, ``ProfileKwargs`` (for ``profile()``), ``HangDetectionKwargs`` (the hang
            watchdog; see ``lockstep.diagnostics``).
        dynamo_backend: a ``torch.compile`` backend name; the model is compiled before the DDP wrap.
        dynamo_plugin: full ``torch.compile`` settings (``TorchDynamoPlugin``).
        debug: check tensor shapes across ranks before each collective (also ``LOCKSTEP_DEBUG=1``).
        preemption_signals: signals that mean "save and stop soon" once the loop checks ``should_stop``.
        preemption_grace_period: seconds the cluster allows after such a signal; longer saves are reported.
        step_timing: measure every optimizer step (time in data, forward+backward, optimizer, checkpoint;
            samples/s, tokens/s, FLOP/s, MFU) into ``step_stats``; ``ThroughputKwargs`` tunes it.
        log_with: experiment trackers: ``"jsonl"``, ``"csv"``, ``"tensorboard"``, ``"mlflow"``, ``"wandb"``,
            ``"all"`` (those installed), GeneralTracker objects, or a list of them.
        fsdp_plugin: shard the model with FSDP2 (``FullyShardedDataParallelPlugin``); also selected by the
            launcher's ``distributed_type: FSDP``.
        split_batches, dispatch_batches, even_batches, use_seedable_sampler: Accelerate's deprecated
            spellings of the ``DataLoaderConfiguration`` fields: applied, with a FutureWarning.
        deepspeed_plugin, deepspeed_plugins: DeepSpeed ZeRO (``DeepSpeedPlugin``).
        parallelism_config: an N-D layout (``ParallelismConfig``: tensor parallel, FSDP, HSDP) on a device mesh.
        torch_tp_plugin, megatron_lm_plugin: not built; passing them raises NotImplementedError.
        elastic_keep_global_batch: when ``load_state`` restores a checkpoint saved on another number of
            processes, keep the global batch by changing ``gradient_accumulation_steps`` (a ValueError when
            the division is not exact). Off: the per-process batch and accumulation steps stay, so the global
            batch follows the number of processes. Either way rank 0 logs one restart line.
        **add_ons: the keywords of registered add-ons and layers, each taking its config object (``lockstep
            env`` lists them): ``fault_tolerance`` trains as one replica group of a fault-tolerant job
            (``FaultToleranceConfig``, on torchft: gradients are averaged over the live groups of each step,
            and a lost group leaves the others stepping); a layer's keyword adds its step hooks. A keyword
            nothing registered claims is a TypeError. Not given: the add-on's section that ``lockstep
            launch`` passed (its flags or config file), if any.
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool = NOT_GIVEN,
        mixed_precision: str | PrecisionType | None = None,
        gradient_accumulation_steps: int | None = None,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        rng_types: Sequence[str] | None = None,
        log_with: Any = None,
        project_dir: str | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: Sequence[Any] | None = None,
        dynamo_backend: str | None = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        deepspeed_plugins: Any = None,
        parallelism_config: Any = None,
        debug: bool | None = None,
        preemption_signals: Sequence[str] = DEFAULT_SIGNALS,
        preemption_grace_period: float = 30.0,
        step_timing: bool | None = None,
        dispatch_batches: bool | None = NOT_GIVEN,
        even_batches: bool = NOT_GIVEN,
        use_seedable_sampler: bool = NOT_GIVEN,
        elastic_keep_global_batch: bool = False,
        **add_ons: Any,
    ) -> None:
        reject_unbuilt_features(
            torch_tp_plugin=torch_tp_plugin,
            megatron_lm_plugin=megatron_lm_plugin,
        )
        dataloader_config = apply_deprecated_dataloader_arguments(
            dataloader_config,
            {
                "split_batches": split_batches,
                "dispatch_batches": dispatch_batches,
                "even_batches": even_batches,
                "use_seedable_sampler": use_seedable_sampler,
            },
        )
        settings = resolve_settings(
            mixed_precision=mixed_precision,
            gradient_accumulation_steps=gradient_accumulation_steps,
            gradient_accumulation_plugin=gradient_accumulation_plugin,
            dataloader_config=dataloader_config,
            project_dir=project_dir,
            project_config=project_config,
            dynamo_backend=dynamo_backend,
            dynamo_plugin=dynamo_plugin,
            rng_types=rng_types,
            kwargs_handlers=kwargs_handlers,
            fsdp_plugin=fsdp_plugin,
            deepspeed_plugin=deepspeed_plugin,
            deepspeed_plugins=deepspeed_plugins,
            parallelism_config=parallelism_config,
        )
        self.settings = settings
        self._settings = SettingsView(settings)
        self.state = self._build_state(cpu=cpu, debug=debug)
        self._process = ProcessView(self.state)
        self._unconfigured = UnconfiguredFeatures()
        self.gradient_state = GradientState(
            gradient_accumulation_plugin=self.settings.gradient_accumulation_plugin
        )
        self._accumulation = GradientAccumulation(self.gradient_state)
        self.backend = self._build_backend(add_ons)
        self._mesh = MeshView(self.state, self.backend)
        self._collectives = CollectivesView(self.state, self.gradient_state, self.backend)
        self._prepared = PreparedObjects()
        self._trackers = Trackers(
            log_with, project=self.project_configuration, is_main_process=self.is_main_process
        )
        self._tracking = TrackingView(self._trackers)
        self._step_timer = self._build_step_timer(step_timing)
        self._saving = CheckpointingView(
            prepared=self._prepared,
            backend=self.backend,
            state=self.state,
            project=self.project_configuration,
            accumulation=self._accumulation,
            step_timer=self._step_timer,
            keep_global_batch=elastic_keep_global_batch,
            record_event=self._trackers.record_event,
        )
        self._live = share_live_state(self.backend, self._prepared, self._accumulation)  # fault tolerance
        self._preemption = PreemptionWatcher(preemption_signals, preemption_grace_period)
        self._step_hooks = self._build_step_hooks()
        self._preparer = self._build_preparer(
            device_placement=device_placement, step_scheduler_with_optimizer=step_scheduler_with_optimizer
        )

    # -- build steps ------------------------------------------------------------------------------
    def _build_state(self, *, cpu: bool, debug: bool | None) -> AcceleratorState:
        init = self.settings.handlers.init
        kwargs: dict[str, Any] = {"debug": debug}
        if init is not None:
            kwargs.update(backend=init.backend, timeout=init.timeout, init_method=init.init_method)
        return AcceleratorState(mixed_precision=self.settings.mixed_precision.value, cpu=cpu, **kwargs)

    def _build_backend(self, add_ons: Mapping[str, Any]) -> Backend:
        handlers = self.settings.handlers
        given = given_add_ons(add_ons, launcher_settings())  # keywords, else lockstep launch's sections
        backend_plugins = handlers.backend_plugins + tuple(p for s, p in given if isinstance(s, BackendSpec))
        self._layers = [(spec, plugin) for spec, plugin in given if not isinstance(spec, BackendSpec)]
        layout = self.settings.parallelism_config
        if layout is not None:
            build_layout(layout, self.state)
        backend = select_backend(
            self.state,
            mixed_precision=self.settings.mixed_precision,
            autocast_kwargs=handlers.autocast,
            scaler_kwargs=handlers.scaler,
            ddp_kwargs=handlers.ddp,
            dynamo_plugin=self.settings.dynamo_plugin,
            fsdp_plugin=self.settings.fsdp_plugin,
            deepspeed_plugins=self.settings.deepspeed_plugins,
            parallelism_config=layout,
            plugins=backend_plugins,
        )
        self.state._record(
            parallelism_config=layout,
            distributed_type=backend.distributed_type,
            dynamo_plugin=self.settings.dynamo_plugin,
            fsdp_plugin=self.settings.fsdp_plugin,
            deepspeed_plugins=self.settings.deepspeed_plugins,
        )
        return backend

    def _build_step_timer(self, step_timing: bool | None) -> Any:
        return build_step_timer(
            step_timing,
            self.settings.handlers.throughput,
            device=self.device,
            num_processes=self.num_processes,
            prepared=self._prepared,
            mixed_precision=self.mixed_precision,
            log=lambda values, step: self._trackers.log(values, step=step),
            logging_active=lambda: self._trackers.active,
        )

    def _build_step_hooks(self) -> StepHooks:
        """The layers on from the start, in this order: the step timer, the hang watchdog's progress note,
        the backend's own (fault tolerance's commit answer)."""
        hooks = StepHooks()
        if isinstance(self._step_timer, StepHook):  # step timing on
            hooks.add(self._step_timer)
        watchdog = self._start_hang_watchdog()
        if watchdog is not None:
            hooks.add(watchdog)
        layer = self.backend.capability(StepHook)
        if layer is not None:
            hooks.add(layer)
        for spec, plugin in self._layers:  # registered layers (lockstep.config.layer_specs), by name
            for hook in spec.build_hooks(plugin, self):
                hooks.add(hook)
        return hooks

    def _start_hang_watchdog(self) -> StepHook | None:
        """Start lockstep.diagnostics' watchdog (a hang becomes a report and exit code 124); returns its step
        hook (progress on every optimizer step), or None when it is off."""
        from lockstep.diagnostics import active_watchdog

        watchdog = active_watchdog.start(
            rank=self.process_index,
            world_size=self.num_processes,
            handler=self.settings.handlers.hang,
            logging_dir=self.logging_dir,
        )
        return None if watchdog is None else active_watchdog.StepProgress()

    def add_step_hook(self, hook: StepHook) -> None:
        """Run ``hook`` on every training step from now on, after the layers added before it: around the
        batches of prepared loaders, ``backward`` and every synchronising ``optimizer.step()``, and ask it
        whether each step is applied (see :mod:`lockstep.step_hooks`). Objects prepared already run it too.

        Example:
            >>> from lockstep.step_hooks import StepHook
            >>> class VetoAll(StepHook):
            ...     def commit(self, optimizer: object) -> bool:
            ...         return False
            >>> accelerator = Accelerator(cpu=True)
            >>> accelerator.add_step_hook(VetoAll())
        """
        self._step_hooks.add(hook)

    def _build_preparer(self, *, device_placement: bool, step_scheduler_with_optimizer: bool) -> Preparer:
        return Preparer(
            backend=self.backend,
            prepared=self._prepared,
            settings=self.settings,
            state=self.state,
            device_placement=device_placement,
            step_scheduler_with_optimizer=step_scheduler_with_optimizer,
            step_hooks=self._step_hooks,
        )

    # -- preparation settings (may be changed between prepare calls, as in Accelerate) ---------------
    @property
    def device_placement(self) -> bool:
        """Move prepared models and batches to ``self.device`` (the default of ``prepare``'s objects)."""
        return self._preparer.device_placement

    @device_placement.setter
    def device_placement(self, device_placement: bool) -> None:
        self._preparer.device_placement = device_placement

    @property
    def step_scheduler_with_optimizer(self) -> bool:
        """Schedulers prepared from now on follow the optimizer (see ``lockstep.scheduler``)."""
        return self._preparer.step_scheduler_with_optimizer

    @step_scheduler_with_optimizer.setter
    def step_scheduler_with_optimizer(self, step_with_optimizer: bool) -> None:
        self._preparer.step_scheduler_with_optimizer = step_with_optimizer

    # -- resolved settings (the rest: SettingsView) -------------------------------------------------
    @property
    def distributed_type(self) -> DistributedType:
        """How the processes share the work; the backend's, unless code set ``state.distributed_type``."""
        return self.state.distributed_type

    @property
    def precision(self) -> Precision:
        """The backend's mixed-precision object (autocast context, fp16 gradient scaler)."""
        return self.backend.precision

    @property
    def native_amp(self) -> bool:
        return self.precision.enabled

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.precision.scaler

    # -- gradient accumulation state --------------------------------------------------------------
    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        resolve_accumulation(steps, None, {})
        self.gradient_state.plugin_kwargs["num_steps"] = steps

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, sync_gradients: bool) -> None:
        self.gradient_state._set_sync_gradients(sync_gradients)

    @property
    def step(self) -> int:
        """Micro-batches since the last gradient synchronisation (``accumulate()``'s counter)."""
        return self._accumulation.step

    @step.setter
    def step(self, step: int) -> None:
        self._accumulation.step = step

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether any prepared optimizer skipped its last step (fp16 overflow)."""
        return any(optimizer.step_was_skipped for optimizer in self._prepared.optimizers)

    def capability(self, kind: type[C]) -> C | None:
        """What only some backends can do, if this one can (``lockstep.backends.PipelineSchedule``,
        ``ContextParallel``, ``JointPreparation``, ``ShardedCheckpointIO``, ``TrainingStateTransfer``): the
        object that does it, or None. A lockstep extension: ask it instead of which backend is active.

        Example:
            >>> from lockstep.backends import PipelineSchedule
            >>> Accelerator(cpu=True).capability(PipelineSchedule) is None
            True
        """
        return self.backend.capability(kind)

    @property
    def deepspeed_engine_wrapped(self) -> Any:
        """Accelerate's wrapper of the DeepSpeed engine that ``backward`` steps; exists only under DeepSpeed."""
        joint = self.backend.capability(JointPreparation)
        engine = joint.stepping_engine() if joint is not None else None
        if engine is None:
            raise AttributeError(
                "'Accelerator' has no attribute 'deepspeed_engine_wrapped': no DeepSpeed engine."
            )
        from lockstep.accelerator.engine_stepped import DeepSpeedEngineWrapper

        return DeepSpeedEngineWrapper(engine)

    # -- prepare ----------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: Sequence[bool | None] | None = None) -> Any:
        """Prepare models, optimizers, schedulers and dataloaders; returns them in the same order.

        Objects of other types pass through unchanged; preparing an object twice returns it as is.

        Example:
            >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # doctest: +SKIP
        """
        placements = self._preparer.placements(len(args), device_placement)
        result = list(args)
        together = self._preparer.together(args)  # a backend that builds model and optimizer as one
        # Models first (a sharding backend re-binds optimizers to their parameters), schedulers last
        # (they need the prepared optimizers); each through the prepare_* method a subclass may override.
        for index in models_first(args):
            result[index] = (
                together[index] if index in together else self._prepare_one(args[index], placements[index])
            )
        result = [self.prepare_scheduler(obj) if is_unprepared_scheduler(obj) else obj for obj in result]
        if self._live is not None and any(isinstance(obj, torch.optim.Optimizer) for obj in args):
            self._live.join()  # a replica group that comes back heals now, before it reads a batch
        return result[0] if len(result) == 1 else tuple(result)

    def _prepare_one(self, obj: Any, placement: bool | None) -> Any:
        if isinstance(obj, DataLoader):
            return self.prepare_data_loader(obj, device_placement=placement)
        if isinstance(obj, nn.Module):
            return self.prepare_model(obj, device_placement=placement)
        if isinstance(obj, torch.optim.Optimizer):
            return self.prepare_optimizer(obj, device_placement=placement)
        return obj

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """Place the model on the device, run its forward in the mixed precision and wrap it for the backend.

        Args:
            model: the model.
            device_placement: override the Accelerator's ``device_placement`` for this model.
            evaluation_mode: skip the distributed wrapper (for models that are never trained).
        """
        return self._preparer.model(model, device_placement, evaluation_mode=evaluation_mode)

    def verify_device_map(self, model: nn.Module) -> bool:
        """Whether ``model`` (or a submodule) was dispatched over several devices with a ``device_map`` such as
        transformers' ``device_map="auto"`` (an ``hf_device_map`` of more than one entry). Such a model is
        never moved by ``prepare``, and cannot be prepared for training on several processes."""
        return has_device_map(model)

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> AcceleratedOptimizer:
        """Wrap an optimizer so that it steps only on synchronised, non-overflowing gradients."""
        return self._preparer.optimizer(optimizer, device_placement)

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap an LR scheduler so that it follows the prepared optimizers (see ``lockstep.scheduler``)."""
        return self._preparer.scheduler(scheduler)

    def prepare_data_loader(
        self, data_loader: DataLoader, device_placement: bool | None = None
    ) -> DataLoader:
        """Shard a DataLoader across processes and move its batches to the device."""
        return self._preparer.data_loader(data_loader, device_placement)

    def skip_first_batches(self, dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
        """A loader that starts after ``num_batches`` batches of the current epoch."""
        return _skip_first_batches(dataloader, num_batches)

    # -- training step ----------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by the accumulation steps and scaled under fp16."""
        loss = self.backend.scale_for_accumulation(loss, self.gradient_accumulation_steps)
        with self._step_hooks.around_backward():
            self.backend.backward(loss, **kwargs)

    def pipeline_step(
        self, model: nn.Module, *args: Any, target: Any = None, loss_fn: Any = None, **kwargs: Any
    ) -> torch.Tensor | None:
        """One pipeline-parallel step (``ParallelismConfig(pp_size=...)``): forward and backward of every
        micro-batch of ``model(*args, **kwargs)`` against ``target``, divided by the accumulation steps like
        :meth:`backward`. Returns the batch's mean loss on the ranks holding the last stage, else None.

        Example:
            >>> loss = accelerator.pipeline_step(model, x, target=y, loss_fn=F.mse_loss)  # doctest: +SKIP
        """
        schedule = self.backend.capability(PipelineSchedule)
        if schedule is None:
            raise RuntimeError(NO_PIPELINE)
        with self._step_hooks.around_backward():
            return schedule.pipeline_step(
                model,
                args,
                kwargs,
                target=target,
                loss_fn=loss_fn,
                accumulation_steps=self.gradient_accumulation_steps,
            )

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """Accumulate gradients over ``gradient_accumulation_steps`` micro-batches.

        On micro-steps the models skip their gradient all-reduce (``no_sync``) and prepared optimizers
        skip ``step()``; the last batch of a dataloader always synchronises.

        Example:
            >>> for batch in loader:  # doctest: +SKIP
            ...     with accelerator.accumulate(model):
            ...         accelerator.backward(model(batch).sum())
            ...         optimizer.step()
            ...         optimizer.zero_grad()
        """
        self._accumulation.advance()
        sync_anyway = self.use_distributed and self.gradient_state.sync_each_batch
        with contextlib.ExitStack() as stack:
            if not (self.sync_gradients or sync_anyway):
                for model in models:
                    stack.enter_context(self.backend.no_sync(model))
            yield

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A context in which backward passes of ``model`` do not all-reduce gradients."""
        return self.backend.no_sync(model)

    def trigger_sync_in_backward(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A context in which the backward pass of ``model`` synchronises gradients although its forward (or
        the whole step) ran under :meth:`no_sync` or an ``accumulate()`` micro-step; the gradients
        accumulated so far are synchronised with it. A no-op on one process.

        Example:
            >>> with accelerator.no_sync(model):  # doctest: +SKIP
            ...     loss_a, loss_b = model(input_a).sum(), model(input_b).sum()
            >>> accelerator.backward(loss_a)  # doctest: +SKIP
            >>> with accelerator.trigger_sync_in_backward(model):  # doctest: +SKIP
            ...     accelerator.backward(loss_b)  # all-reduces loss_a's and loss_b's gradients
        """
        return self.backend.sync_next_backward(model)

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> contextlib.AbstractContextManager:
        """Run a block under this Accelerator's mixed precision (a no-op in full precision)."""
        return self.precision.autocast_context(autocast_handler)

    def profile(self, profile_handler: ProfileKwargs | None = None) -> contextlib.AbstractContextManager:
        """Profile the block with ``torch.profiler``; yields the profiler (call ``prof.step()`` per step when
        ``schedule_option`` is set). Settings: ``profile_handler``, else the ``ProfileKwargs`` given in
        ``kwargs_handlers``, else torch's defaults. With ``output_trace_dir``, every process writes its Chrome
        trace there (``profile_<rank>.json``) and the processes wait for each other.

        Example:
            >>> accelerator = Accelerator(cpu=True)
            >>> with accelerator.profile(ProfileKwargs(activities=["cpu"])) as prof:
            ...     _ = torch.ones(8, 8) @ torch.ones(8, 8)
            >>> any(event.key == "aten::mm" for event in prof.key_averages())
            True
        """
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        from lockstep.accelerator.profiling import profile  # torch.profiler loads on first use

        return profile(handler, process_index=self.process_index, barrier=self.wait_for_everyone)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer | Sequence[Any] | None = None) -> None:
        """Divide gradients by the fp16 loss scale (once per step; a no-op otherwise)."""
        if self.precision.scaler is None or not self.sync_gradients:
            return
        optimizers = self._prepared.optimizers if optimizer is None else optimizer
        if not isinstance(optimizers, Sequence):
            optimizers = [optimizers]
        for opt in optimizers:
            self.precision.unscale(opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip the gradient norm (after unscaling under fp16); returns the total norm before clipping."""
        parameters = list(parameters)
        self.unscale_gradients()
        return self.backend.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Clip gradients to ``[-clip_value, clip_value]`` (after unscaling under fp16)."""
        parameters = list(parameters)
        self.unscale_gradients()
        nn.utils.clip_grad_value_(parameters, clip_value)

    def unwrap_model(
        self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> nn.Module:
        """The user's module without distributed wrappers.

        Args:
            model: a prepared model.
            keep_fp32_wrapper: keep the mixed-precision forward wrapper.
            keep_torch_compile: keep the ``torch.compile`` wrapper.
        """
        unwrapped = self.backend.unwrap_model(model, keep_torch_compile=keep_torch_compile)
        if not keep_fp32_wrapper:
            remove_forward_wrapper(self.backend.unwrap_model(unwrapped, keep_torch_compile=False))
        return unwrapped

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The model's state dict (of the unwrapped model by default)."""
        target = self.unwrap_model(model, keep_torch_compile=False) if unwrap else model
        return self.backend.full_state_dict(target)

    def wait_for_everyone(self) -> None:
        """A barrier across all processes. (A ``save_state`` needs none: it returns on every rank with the
        checkpoint folder final; only its fsync may still run, on a thread.)"""
        self._process.wait_for_everyone()

    # -- memory and shutdown ----------------------------------------------------------------------
    def free_memory(self, *objects: Any) -> list[Any]:
        """Drop the Accelerator's references to prepared objects and free cached memory (DeepSpeed engines
        are destroyed)."""
        joint = self.backend.capability(JointPreparation)
        for model in self._prepared.models if joint is not None else ():
            joint.release(model)
        self._prepared.forget_prepared()
        self.step = 0
        return release_memory(*objects)

    clear = free_memory

    def end_training(self) -> None:
        """Finish the run: close the trackers, finish background saves, stop the hang watchdog.

        The process group stays up until the process exits, where lockstep tears it down safely (or until
        ``PartialState().destroy_process_group()``), so code after ``end_training()`` can still synchronise:
        transformers' ``*_no_trainer.py`` examples call ``wait_for_everyone()`` and save the model after it.
        (Accelerate destroys the group here, and those scripts then fail on several processes.)
        """
        from lockstep.diagnostics import active_watchdog

        self._trackers.finish()
        self._saving.wait_if_started()
        self.free_memory()
        active_watchdog.stop()

    # -- saving -----------------------------------------------------------------------------------
    @property
    def step_stats(self) -> dict[str, float]:
        """The last optimizer step's time breakdown and rates (``Accelerator(step_timing=True)``).

        Keys: ``time/data``, ``time/forward_backward``, ``time/optimizer``, ``time/checkpoint``,
        ``time/other`` (they add up to ``time/step``), ``time/communication`` (DDP), ``samples_per_second``,
        ``tokens_per_second``, ``flops_per_second``, ``mfu`` (known GPUs); see ``lockstep.throughput``.
        """
        return self._step_timer.stats

    # -- preemption and restarts -------------------------------------------------------------------
    @property
    def should_stop(self) -> bool:
        """True on every rank once any rank received a preemption signal (SIGTERM, SIGUSR1).

        Check it on every rank at the same point of the loop, after ``optimizer.step()``; the first check
        installs the signal handlers. It costs one small all-reduce per check. A background checkpoint save
        (``async_save=True`` or ``durable="background"``) that failed on any rank raises its error here, on
        every rank.

        Example:
            >>> for batch in train_dataloader:  # doctest: +SKIP
            ...     ...
            ...     optimizer.step()
            ...     if accelerator.should_stop:
            ...         accelerator.checkpoint_and_exit()  # saves, then exits with 143
        """
        manager = self._saving.started_manager()  # a background save's failure is raised here, on every rank
        if manager is None:
            return self._preemption.should_stop(self.device)
        failed = manager.writer.failed
        return self._preemption.should_stop(
            self.device, save_failed=failed, on_save_failure=manager.raise_background_failure
        )

    def checkpoint_and_exit(self, output_dir: str | None = None) -> None:
        """Save the state (as :meth:`save_state`), shut down cleanly and exit with ``128 + signal``."""
        started = time.monotonic()
        folder = self.save_state(output_dir, durable="sync")  # committed before the process exits
        seconds = time.monotonic() - started
        warning = self._preemption.report_save(seconds)
        if warning is not None and self.is_main_process:
            warnings.warn(warning, stacklevel=2)
        self.print(f"lockstep: saved {folder} in {seconds:.1f} s after a preemption signal; exiting.")
        self.end_training()
        exit_now(self._preemption.exit_code)

    def resume_from_latest_checkpoint(self) -> str | None:
        """Load the project's newest valid checkpoint if there is one; returns its folder (else None).

        The one line that makes a loop survive restarts (``lockstep launch --max-restarts N``):

        Example:
            >>> accelerator.resume_from_latest_checkpoint()  # doctest: +SKIP
        """
        root = self._saving.manager.automatic_root()
        if root is None:
            raise ValueError(
                "resume_from_latest_checkpoint() needs Accelerator(project_dir=...) (checkpoints are looked for "
                "in project_dir/checkpoints)."
            )
        try:
            self.load_state()
        except FileNotFoundError:
            return None
        return str(self._saving.manager.loaded_from)
