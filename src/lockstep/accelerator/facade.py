"""The Accelerator: the facade a training script talks to.

Every method is a few lines that delegate to the part that does the work, each built once in
``__init__`` with exactly what it needs: the resolved settings (:mod:`.settings`), the process state
(:mod:`lockstep.state`), the backend with its precision (:mod:`lockstep.backends.registry`), the registry
of prepared objects (:mod:`.prepared`) filled by the :class:`~.preparation.Preparer`, the accumulation
position (:mod:`.accumulation`), the trackers (:mod:`.trackers`), the step timer
(:mod:`lockstep.throughput`), the checkpoint manager (:mod:`.checkpoints`, built on first use), the
preemption watcher (:mod:`.preemption`) and the profiler (:mod:`.profiling`). Collectives are
:mod:`lockstep.collectives`. Groups of Accelerate's members that need one part only are small objects of
their own, and the facade's members of those groups are one-line delegations written here: who this
process is (:mod:`.process_view`), the resolved settings (:mod:`.settings_view`), the device mesh
(:mod:`.mesh_view`), collectives (:mod:`.collectives_view`), trackers (:mod:`.tracking_view`) and
checkpoints (:mod:`.checkpointing_view`). That is why this file may be longer than others
(``tests/test_architecture.py``'s ``DELEGATION_MAX_FILE_LINES``).

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
from lockstep.backends.capabilities import NO_PIPELINE, C, JointPreparation, LiveRecovery, PipelineSchedule
from lockstep.backends.registry import select_backend
from lockstep.config.backend_specs import BackendSpec, given_add_ons
from lockstep.config.dataloader import DataLoaderConfiguration
from lockstep.config.enums import DistributedType, PrecisionType
from lockstep.config.kwargs import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    FP8BackendType,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)
from lockstep.config.layer_specs import layers_from_layout
from lockstep.config.plugins import GradientAccumulationPlugin, TorchDynamoPlugin
from lockstep.config.project import ProjectConfiguration
from lockstep.data import skip_first_batches as _skip_first_batches
from lockstep.memory import release_memory
from lockstep.precision import Precision, remove_forward_wrapper
from lockstep.state import AcceleratorState, GradientState
from lockstep.step_hooks import StepHook, StepHooks
from lockstep.throughput.build import build_step_timer

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lockstep.accelerator.checkpoints import SaveReport
    from lockstep.backends.base import Backend
    from lockstep.config.parallelism import ParallelismConfig
    from lockstep.tracking.base import GeneralTracker

F = TypeVar("F", bound=Callable[..., Any])


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
            live_recovery=lambda: self.capability(LiveRecovery),
        )
        self._preemption = PreemptionWatcher(preemption_signals, preemption_grace_period)
        self._step_hooks = self._build_step_hooks()
        # Fault tolerance: what a healing replica group takes from a live peer besides models and optimizers.
        self._live = share_live_state(
            self.capability(LiveRecovery), self.backend.precision.scaler, self._prepared, self._accumulation
        )
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
        layout = self.settings.parallelism_config
        self._layers = [(spec, plugin) for spec, plugin in given if not isinstance(spec, BackendSpec)]
        self._layers += layers_from_layout(layout)  # turned on by the layout (expert parallelism: ep_size)
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
        then the registered layers this run asks for (fault tolerance, ...: :mod:`lockstep.config.layer_specs`)."""
        hooks = StepHooks()
        if isinstance(self._step_timer, StepHook):  # step timing on
            hooks.add(self._step_timer)
        watchdog = self._start_hang_watchdog()
        if watchdog is not None:
            hooks.add(watchdog)
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

    # -- who this process is (ProcessView) --------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._process.device

    @property
    def num_processes(self) -> int:
        return self._process.num_processes

    @property
    def process_index(self) -> int:
        return self._process.process_index

    @property
    def local_process_index(self) -> int:
        return self._process.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self._process.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self._process.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self._process.is_last_process

    @property
    def use_distributed(self) -> bool:
        return self._process.use_distributed

    @property
    def multi_device(self) -> bool:
        """True for data parallel over accelerator devices, one per process (DDP on GPUs, XPUs or MPS); False
        on one process, for DDP on CPUs and for sharded training, as in Accelerate."""
        return self._process.multi_device

    @property
    def is_fsdp2(self) -> bool:
        """Whether models are sharded with FSDP2 (``fully_shard``); lockstep's FSDP is always FSDP2."""
        return self._process.is_fsdp2

    @property
    def deepspeed_plugin(self) -> Any:
        """The active ``DeepSpeedPlugin``, or None when DeepSpeed is not used."""
        return self._process.deepspeed_plugin

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        """Whether torch's composable parallelism (FSDP2 on DTensors) is in use: ``is_fsdp2``, as in Accelerate."""
        return self._process.is_composable_parallelism_enabled

    @property
    def should_save_model(self) -> bool:
        """Whether this process writes model files: the local main process (one per machine), as in Accelerate
        without a ``ParallelismConfig``."""
        return self._process.should_save_model

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        self._process.print(*args, **kwargs)

    def main_process_first(self) -> contextlib.AbstractContextManager:
        """A block the main process runs first; the other processes wait for it, then run it."""
        return self._process.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager:
        """A block the local main process (one per machine) runs before the other processes of its machine."""
        return self._process.local_main_process_first()

    def split_between_processes(
        self, inputs: Any, apply_padding: bool = False
    ) -> contextlib.AbstractContextManager:
        """A block that receives this process's share of ``inputs`` (a list, tuple, dict or tensor); with ``apply_padding`` the last element is repeated so that every share has the same length."""
        return self._process.split_between_processes(inputs, apply_padding)

    def on_main_process(self, function: F | None = None) -> F:
        """Decorator: the function runs on the main process only (elsewhere the call does nothing)."""
        return self._process.on_main_process(function)

    def on_local_main_process(self, function: F | None = None) -> F:
        """Decorator: the function runs on the local main process of each machine only."""
        return self._process.on_local_main_process(function)

    def on_last_process(self, function: F) -> F:
        """Decorator: the function runs on the last process only."""
        return self._process.on_last_process(function)

    def on_process(self, function: F | None = None, process_index: int | None = None) -> Any:
        """Decorator: the function runs on process ``process_index`` only."""
        return self._process.on_process(function, process_index)

    def on_local_process(self, function: F | None = None, local_process_index: int | None = None) -> Any:
        """Decorator: the function runs on local process ``local_process_index`` of each machine only."""
        return self._process.on_local_process(function, local_process_index)

    def join_uneven_inputs(
        self, joinables: Sequence[Any], even_batches: bool | None = None
    ) -> contextlib.AbstractContextManager:
        """Let DDP models train on loaders of different lengths per process (``torch.distributed.algorithms.Join``)."""
        return self._process.join_uneven_inputs(joinables, even_batches)

    # -- resolved settings (SettingsView) ---------------------------------------------------------
    @property
    def mixed_precision(self) -> str:
        return self._settings.mixed_precision

    @property
    def fsdp_plugin(self) -> Any:
        """The FSDP settings in force (a ``FullyShardedDataParallelPlugin``, whether passed to the constructor
        or chosen by the launcher's config), or None when the model is not sharded with FSDP."""
        return self._settings.fsdp_plugin

    @property
    def deepspeed_config(self) -> dict[str, Any]:
        """The active DeepSpeed config ("auto" values filled at ``prepare``). Like Accelerate, the attribute
        exists only when DeepSpeed is used."""
        return self._settings.deepspeed_config

    @property
    def project_configuration(self) -> ProjectConfiguration:
        return self._settings.project_configuration

    @property
    def project_dir(self) -> str | None:
        return self._settings.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self._settings.logging_dir

    @property
    def save_iteration(self) -> int:
        return self._settings.save_iteration

    @property
    def rng_types(self) -> list[str]:
        return self._settings.rng_types

    @property
    def dataloader_config(self) -> DataLoaderConfiguration:
        """How prepared dataloaders split and deliver data (the ``DataLoaderConfiguration`` in force).

        Assignable, as in Accelerate: loaders prepared afterwards follow the new configuration.

        Example:
            >>> from lockstep import Accelerator
            >>> accelerator = Accelerator()
            >>> accelerator.dataloader_config = DataLoaderConfiguration(even_batches=False)
            >>> accelerator.even_batches
            False
        """
        return self._settings.dataloader_config

    @dataloader_config.setter
    def dataloader_config(self, config: DataLoaderConfiguration) -> None:
        self._settings.dataloader_config = config

    @property
    def split_batches(self) -> bool:
        return self._settings.split_batches

    @property
    def dispatch_batches(self) -> bool | None:
        return self._settings.dispatch_batches

    @property
    def even_batches(self) -> bool:
        return self._settings.even_batches

    @even_batches.setter
    def even_batches(self, even_batches: bool) -> None:
        self._settings.even_batches = even_batches

    @property
    def use_seedable_sampler(self) -> bool:
        return self._settings.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        return self._settings.non_blocking

    @property
    def use_stateful_dataloader(self) -> bool:
        """Whether prepared loaders are also torchdata ``StatefulDataLoader``\\ s
        (``DataLoaderConfiguration(use_stateful_dataloader=True)``; needs ``pip install torchdata``)."""
        return self._settings.use_stateful_dataloader

    @property
    def ddp_handler(self) -> DistributedDataParallelKwargs | None:
        """The ``DistributedDataParallelKwargs`` given in ``kwargs_handlers`` (None when none was)."""
        return self._settings.ddp_handler

    @property
    def scaler_handler(self) -> GradScalerKwargs | None:
        """The ``GradScalerKwargs`` given in ``kwargs_handlers`` (None when none was)."""
        return self._settings.scaler_handler

    @property
    def init_handler(self) -> InitProcessGroupKwargs | None:
        """The ``InitProcessGroupKwargs`` given in ``kwargs_handlers`` (None when none was)."""
        return self._settings.init_handler

    @property
    def autocast_handler(self) -> AutocastKwargs | None:
        """The ``AutocastKwargs`` given in ``kwargs_handlers`` (None when none was)."""
        return self._settings.autocast_handler

    @property
    def profile_handler(self) -> ProfileKwargs | None:
        """The ``ProfileKwargs`` given in ``kwargs_handlers``, used by ``profile()`` (None when none was)."""
        return self._settings.profile_handler

    # -- preparation settings (may be changed between prepare calls, as in Accelerate) ------------
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

    # -- the backend's settings -------------------------------------------------------------------
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
        """What only some backends or layers can do, if this run can (``lockstep.backends.PipelineSchedule``,
        ``ContextParallel``, ``JointPreparation``, ``ShardedCheckpointIO``, ``LiveRecovery``): the object that
        does it (the backend's, else a step hook's), or None. A lockstep extension: ask it instead of which
        backend or layer is active.

        Example:
            >>> from lockstep.backends import PipelineSchedule
            >>> Accelerator(cpu=True).capability(PipelineSchedule) is None
            True
        """
        found = self.backend.capability(kind)
        return found if found is not None else self._step_hooks.capability(kind)

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

    # -- the N-D device mesh (MeshView) -----------------------------------------------------------
    @property
    def parallelism_config(self) -> ParallelismConfig | None:
        """The ``ParallelismConfig`` the Accelerator was given (or the launcher set), else None."""
        return self._mesh.parallelism_config

    @property
    def torch_device_mesh(self) -> DeviceMesh | None:
        """The N-D device mesh (dimensions in Accelerate's order, only those of size > 1), else None."""
        return self._mesh.torch_device_mesh

    @property
    def tensor_parallel_rank(self) -> int:
        """This process's index in its ``tp`` group (0 when ``tp_size`` is 1)."""
        return self._mesh.tensor_parallel_rank

    @property
    def data_parallel_rank(self) -> int:
        """This process's index along ``dp_replicate`` (0 when ``dp_replicate_size`` is 1)."""
        return self._mesh.data_parallel_rank

    @property
    def data_parallel_shard_rank(self) -> int:
        """This process's index along ``dp_shard`` (0 when ``dp_shard_size`` is 1)."""
        return self._mesh.data_parallel_shard_rank

    @property
    def pipeline_parallel_rank(self) -> int:
        """This process's index along ``pp`` (0 when ``pp_size`` is 1): which pipeline stages it holds."""
        return self._mesh.pipeline_parallel_rank

    @property
    def context_parallel_rank(self) -> int:
        """This process's index along ``cp`` (0 when ``cp_size`` is 1)."""
        return self._mesh.context_parallel_rank

    def maybe_context_parallel(
        self,
        buffers: Sequence[torch.Tensor] | None = None,
        buffer_seq_dims: Sequence[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> contextlib.AbstractContextManager:
        """A block in which the batch is split along the sequence over the ``cp`` ranks (``cp_size > 1``).

        Inside, ``buffers`` hold this rank's chunks of the sequence (a head and a tail chunk, which balances
        causal attention) and ``F.scaled_dot_product_attention`` runs as torch's ring attention, on GPUs and
        on CPUs. On exit the buffers are made whole again, except those in ``no_restore_buffers``. Without
        context parallelism the block runs unchanged, with a warning once, as in Accelerate. Enter it anew
        for every step; the attention must be causal SDPA without a mask or dropout.

        Args:
            buffers: the batch tensors that have a sequence dimension: input ids, labels (shifted already:
                a model that shifts them itself would shift across chunk borders) and position ids.
            buffer_seq_dims: the sequence dimension of each buffer.
            no_restore_buffers: buffers not needed whole after the block (saves the copy back).

        Example:
            >>> for ids, labels in train_dl:  # doctest: +SKIP
            ...     positions = torch.arange(ids.shape[1]).expand_as(ids).contiguous()
            ...     with accelerator.maybe_context_parallel(
            ...         buffers=[ids, labels, positions], buffer_seq_dims=[1, 1, 1],
            ...         no_restore_buffers={ids, labels, positions},
            ...     ):
            ...         logits = model(input_ids=ids, position_ids=positions).logits
            ...         loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            ...         accelerator.backward(loss)
        """
        return self._mesh.maybe_context_parallel(buffers, buffer_seq_dims, no_restore_buffers)

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
        self._step_hooks.before_clip()  # a layer's change of the step's gradients (fault tolerance's average)
        norm = self._step_hooks.clip_grad_norm_(parameters, max_norm, norm_type)  # expert parallelism's clip
        return norm if norm is not None else self.backend.clip_grad_norm_(parameters, max_norm, norm_type)

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
        self._step_hooks.before_checkpoint("get_state_dict")
        target = self.unwrap_model(model, keep_torch_compile=False) if unwrap else model
        return self.backend.full_state_dict(target)

    def wait_for_everyone(self) -> None:
        """A barrier across all processes. (A ``save_state`` needs none: it returns on every rank with the
        checkpoint folder final; only its fsync may still run, on a thread.)"""
        self._process.wait_for_everyone()

    # -- collectives (CollectivesView) ------------------------------------------------------------
    @property
    def flag_tensor(self) -> torch.Tensor | None:
        """The flag :meth:`set_trigger` raises (Accelerate's attribute)."""
        return self._collectives.flag_tensor

    @flag_tensor.setter
    def flag_tensor(self, value: torch.Tensor | None) -> None:
        self._collectives.flag_tensor = value

    def gather(self, tensor: Any) -> Any:
        """Gather tensors (nested structures too) from every process, concatenated along dim 0 (every
        process, tensor-parallel ones included; :meth:`gather_for_metrics` counts each sample once)."""
        return self._collectives.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather like :meth:`gather`, then drop the samples repeated to even out the last batch.

        Over a whole prepared evaluation loader, the gathered values are exactly the dataset's, in order,
        so metrics computed on them equal single-process metrics. On a device mesh with tensor
        parallelism the values are gathered over the data-parallel replicas only (the processes of one
        replica hold the same samples), so each sample still appears once; DTensors are made whole first.
        """
        return self._collectives.gather_for_metrics(input_data, use_gather_object)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Reduce tensors across processes: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"none"`` (this
        rank's value times ``scale``; Accelerate sums instead). On a device mesh with tensor parallelism
        the reduction runs over the data-parallel replicas only, so a per-sample count or loss sum is not
        multiplied by ``tp_size``."""
        return self._collectives.reduce(tensor, reduction, scale)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        """Pad tensors to the largest size in ``dim`` across processes."""
        return self._collectives.pad_across_processes(tensor, dim, pad_index, pad_first)

    def set_trigger(self) -> None:
        """Raise a flag on this process that :meth:`check_trigger` will see on every process."""
        self._collectives.set_trigger()

    def check_trigger(self) -> bool:
        """True on every process when any process called :meth:`set_trigger` (then resets the flag)."""
        return self._collectives.check_trigger()

    # -- trackers (TrackingView) ------------------------------------------------------------------
    def init_trackers(
        self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None
    ) -> None:
        """Start the trackers given as ``log_with`` (on the main process) and record ``config``.

        Example:
            >>> accelerator = Accelerator(log_with="jsonl", project_dir="runs/a")  # doctest: +SKIP
            >>> accelerator.init_trackers("sentiment", config={"lr": 3e-5})  # doctest: +SKIP
            >>> accelerator.log({"loss": 0.5}, step=1)  # doctest: +SKIP
        """
        self._tracking.init_trackers(project_name, config, init_kwargs)

    @property
    def log_with(self) -> list[Any]:
        """The trackers ``log_with`` asked for, checked (names and tracker objects), before ``init_trackers``."""
        return self._tracking.log_with

    @property
    def trackers(self) -> list[GeneralTracker]:
        """The trackers started on this process (empty on processes that do not log)."""
        return self._tracking.trackers

    @trackers.setter
    def trackers(self, trackers: list[GeneralTracker]) -> None:
        self._tracking.trackers = trackers

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Send ``values`` to every started tracker (a no-op on processes that do not log)."""
        self._tracking.log(values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called ``name`` (its underlying object with ``unwrap``); a do-nothing stand-in on
        processes that do not log."""
        return self._tracking.get_tracker(name, unwrap)

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

    # -- saving (CheckpointingView) ---------------------------------------------------------------
    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """Save ``obj`` once per machine set-up (on the main process): torch.save or safetensors."""
        self._saving.save(obj, f, safe_serialization)

    def save_state(
        self,
        output_dir: str | None = None,
        safe_serialization: bool = True,
        async_save: bool = False,
        durable: str = "background",
        **kwargs: Any,
    ) -> str:
        """Save everything needed to resume exactly: weights, optimizers, schedulers, scaler, RNGs of every
        rank, dataloader positions, the accumulation position and registered objects.

        The save is crash-consistent: files go to a staging folder and a manifest, written last, makes the
        folder a checkpoint. Returns the checkpoint folder. With ``async_save=True`` training stops only
        while the state is copied to CPU memory; the files are written in the background and the next save
        (or :meth:`wait_for_checkpoint`) waits for them. ``last_save_report`` says how long training stalled.

        ``durable="background"`` (the default) returns on every rank with the checkpoint folder final: every
        file written (handed to the operating system, as Accelerate's and torch's saves return), the manifest
        (each file's checksum computed from the bytes as they were written), ``latest`` moved and older
        checkpoints rotated out (``total_limit``). Only durability continues, on a thread: the fsync of every
        file and folder, which changes nothing visible; the next ``save_state``, :meth:`load_state`,
        :meth:`wait_for_checkpoint` and :meth:`end_training` wait for it, and its failure is raised on every
        rank by them or by ``should_stop``. A crash of the machine before it ends can tear the new files: the
        checksums then refuse them and ``load_state()`` takes the previous checkpoint (with
        ``total_limit=1``, the one kept, the save fsyncs before it deletes the previous checkpoint).
        ``durable="sync"``, and a save over an existing folder, fsync every file before the manifest.

        A peft model (adapters on a frozen base) is saved without its frozen base: its trainable parameters
        and buffers, and a fingerprint of the base that :meth:`load_state` checks before it loads the
        adapter (:mod:`lockstep.checkpoint.frozen_base`). ``ProjectConfiguration(save_frozen_base=True)``
        saves the whole model, as Accelerate does.

        Example:
            >>> accelerator = Accelerator(project_config=ProjectConfiguration(  # doctest: +SKIP
            ...     project_dir="runs/a", automatic_checkpoint_naming=True, total_limit=3))
            >>> accelerator.save_state()  # runs/a/checkpoints/checkpoint_0  # doctest: +SKIP
        """
        self._step_hooks.before_checkpoint("save_state")
        return self._saving.save_state(output_dir, safe_serialization, async_save, durable, **kwargs)

    def wait_for_checkpoint(self) -> None:
        """Block until a background (``async_save=True``) checkpoint is written and committed, and a
        ``durable="background"`` one durable; raises their failure."""
        self._saving.wait_for_checkpoint()

    @property
    def last_save_report(self) -> SaveReport | None:
        """Folder, training stall in seconds, bytes and mode of the last ``save_state`` (None before one)."""
        return self._saving.last_save_report

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> None:
        """Restore a checkpoint written by :meth:`save_state`; prepared dataloaders continue at the next
        unseen batch. Without ``input_dir``, loads the newest valid checkpoint of the project."""
        self._step_hooks.before_checkpoint("load_state")
        self._saving.load_state(input_dir, **kwargs)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and load these objects (anything with ``state_dict``/``load_state_dict``) with the state."""
        self._saving.register_for_checkpointing(*objects)

    def register_save_state_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """Call ``hook(models, weights, output_dir)`` before saving; it may pop weights it saved itself.

        ``output_dir`` is the folder being written (renamed into place when the save commits): files the
        hook writes there are part of the checkpoint, covered by its manifest and rotated with it.

        Example:
            >>> def save_unet(models, weights, output_dir):  # doctest: +SKIP
            ...     if accelerator.is_main_process:
            ...         models[0].save_pretrained(os.path.join(output_dir, "unet"))
            ...     weights.pop()
            >>> accelerator.register_save_state_pre_hook(save_unet)  # doctest: +SKIP
        """
        return self._saving.register_save_state_pre_hook(hook)

    def register_load_state_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """Call ``hook(models, input_dir)`` before loading; it may pop models it loaded itself."""
        return self._saving.register_load_state_pre_hook(hook)

    def save_model(
        self,
        model: nn.Module,
        save_directory: str,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write the unwrapped model as (sharded) safetensors plus an index, on the main process.

        A peft model is written as peft's ``save_pretrained`` writes it (``adapter_config.json`` and
        ``adapter_model.safetensors``, the adapter gathered from every process), for
        ``PeftModel.from_pretrained(base, save_directory)``; Accelerate writes the base and adapter weights
        into ``model.safetensors`` instead. Every process calls it.
        """
        self._step_hooks.before_checkpoint("save_model")
        self._saving.save_model(model, save_directory, max_shard_size, safe_serialization)

    @property
    def step_stats(self) -> dict[str, float]:
        """The last optimizer step's time breakdown and rates (``Accelerator(step_timing=True)``).

        Keys: ``time/data``, ``time/forward_backward``, ``time/optimizer``, ``time/checkpoint``,
        ``time/other`` (they add up to ``time/step``), ``time/communication`` (DDP), ``samples_per_second``,
        ``tokens_per_second``, ``flops_per_second``, ``mfu`` (known GPUs); see ``lockstep.throughput``.
        """
        return self._step_timer.stats

    # -- preemption and restarts ------------------------------------------------------------------
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

    # -- Accelerate's members for sequence parallelism, FP8 and LOMO, which lockstep does not build ---
    # Each answers as Accelerate does when the feature is not configured.
    fp8_enabled: bool = False
    """Whether training runs in FP8 (``mixed_precision="fp8"``); lockstep has no FP8 backend."""
    has_fp8_handler: bool = False
    delayed_fp8_autocast: bool = False
    fp8_recipe_handler: Any = None
    ao_recipe_handler: Any = None
    te_recipe_handler: Any = None
    msamp_recipe_handler: Any = None
    has_lomo_optimizer: bool = False
    """Whether a LOMO optimizer (``lomo-optim``) was prepared; lockstep does not prepare them."""

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: Any) -> Any:
        """The loader unchanged: without sequence parallelism (``sp_size`` 1) Accelerate returns it as is."""
        return dl

    @property
    def fp8_backend(self) -> FP8BackendType:
        """The FP8 training library: ``FP8BackendType.NO`` (lockstep has no FP8 backend)."""
        return FP8BackendType.NO

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        """Raises: LOMO optimizers fuse the update into backward, which lockstep does not support."""
        raise NotImplementedError(
            "Accelerator.lomo_backward() is not supported: LOMO optimizers (the lomo-optim package's Lomo and "
            "AdaLomo) update the weights inside backward, and lockstep does not prepare them. Use a "
            "torch.optim optimizer with accelerator.backward(loss)."
        )
