"""The Accelerator: the facade a training script talks to.

Every method here is a few lines that delegate: topology to :mod:`lockstep.state`, model wrapping to a
backend chosen by :mod:`lockstep.backends.registry`, precision to :mod:`lockstep.precision`, data to
:mod:`lockstep.data`, communication to :mod:`lockstep.collectives`. Read-only properties, process control
and trackers live in the base classes of ``_accelerator_views``, ``_accelerator_process_control`` and
``_accelerator_tracking``, so that this file stays one screenful per concern.

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
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from lockstep import _process_group, collectives
from lockstep.accelerator import settings as setup
from lockstep.accelerator._process_control import ProcessControl
from lockstep.accelerator._views import AcceleratorViews
from lockstep.accelerator.checkpoints import Checkpointing, save_model
from lockstep.accelerator.optimizer import AcceleratedOptimizer
from lockstep.accelerator.preemption import DEFAULT_SIGNALS, PreemptionWatcher, exit_now
from lockstep.accelerator.scheduler import AcceleratedScheduler
from lockstep.accelerator.trackers import Tracking
from lockstep.backends.registry import select_backend
from lockstep.config.dataloader import DataLoaderConfiguration
from lockstep.config.enums import PrecisionType
from lockstep.config.kwargs import AutocastKwargs
from lockstep.config.plugins import GradientAccumulationPlugin, TorchDynamoPlugin
from lockstep.config.project import ProjectConfiguration
from lockstep.data import prepare_data_loader
from lockstep.data import skip_first_batches as _skip_first_batches
from lockstep.diagnostics import hang_watchdog
from lockstep.memory import release_memory
from lockstep.precision import Precision, remove_forward_wrapper
from lockstep.state import AcceleratorState, GradientState
from lockstep.throughput import build_step_timer
from lockstep.tracking.base import GeneralTracker
from lockstep.tracking.registry import resolve_log_with

_LRScheduler = torch.optim.lr_scheduler.LRScheduler


class Accelerator(AcceleratorViews, ProcessControl, Tracking):
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
        step_scheduler_with_optimizer: prepared schedulers follow the optimizer (see ``lockstep.accelerator.scheduler``).
        kwargs_handlers: ``DistributedDataParallelKwargs``, ``GradScalerKwargs``, ``InitProcessGroupKwargs``,
            ``AutocastKwargs``, ``HangDetectionKwargs`` (the hang watchdog; see ``lockstep.diagnostics``).
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
        deepspeed_plugin, deepspeed_plugins, torch_tp_plugin, megatron_lm_plugin,
            parallelism_config: features not built yet; passing them raises NotImplementedError.
    """

    def __init__(
        self,
        device_placement: bool = True,
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
    ) -> None:
        if fsdp_plugin is not None and deepspeed_plugin is not None:
            setup.resolve_fsdp(fsdp_plugin, deepspeed_plugin, {})  # raises: they cannot be combined
        setup.reject_unbuilt_features(
            deepspeed_plugin=deepspeed_plugin,
            deepspeed_plugins=deepspeed_plugins,
            torch_tp_plugin=torch_tp_plugin,
            megatron_lm_plugin=megatron_lm_plugin,
            parallelism_config=parallelism_config,
        )
        self.settings = setup.resolve_settings(
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
        )
        self.state = self._build_state(cpu=cpu, debug=debug)
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.gradient_state = GradientState(
            gradient_accumulation_plugin=self.settings.gradient_accumulation_plugin
        )
        self.precision = Precision(
            self.settings.mixed_precision,
            self.device,
            autocast_kwargs=self.settings.handlers.autocast,
            scaler_kwargs=self.settings.handlers.scaler,
        )
        self.backend = select_backend(
            self.state,
            ddp_kwargs=self.settings.handlers.ddp,
            dynamo_plugin=self.settings.dynamo_plugin,
            fsdp_plugin=self.settings.fsdp_plugin,
            mixed_precision=self.settings.mixed_precision.value,
        )
        self.state._record(distributed_type=self.backend.distributed_type)
        self.step = 0
        self.flag_tensor: torch.Tensor | None = None
        self._models: list[nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[DataLoader] = []
        self._checkpointing = Checkpointing()
        self._preemption = PreemptionWatcher(preemption_signals, preemption_grace_period)
        self._tracker_specs = resolve_log_with(log_with)
        self.trackers: list[GeneralTracker] = []
        self._step_timer = build_step_timer(self, step_timing, self.settings.handlers.throughput)
        hang_watchdog.start(  # lockstep.diagnostics: a hang becomes a report and exit code 124
            rank=self.process_index,
            world_size=self.num_processes,
            handler=self.settings.handlers.hang,
            logging_dir=self.logging_dir,
        )

    def _build_state(self, *, cpu: bool, debug: bool | None) -> AcceleratorState:
        init = self.settings.handlers.init
        kwargs: dict[str, Any] = {"debug": debug}
        if init is not None:
            kwargs.update(backend=init.backend, timeout=init.timeout, init_method=init.init_method)
        return AcceleratorState(mixed_precision=self.settings.mixed_precision.value, cpu=cpu, **kwargs)

    # -- prepare ----------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: Sequence[bool | None] | None = None) -> Any:
        """Prepare models, optimizers, schedulers and dataloaders; returns them in the same order.

        Objects of other types pass through unchanged; preparing an object twice returns it as is.

        Example:
            >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # doctest: +SKIP
        """
        placements = list(device_placement) if device_placement is not None else [None] * len(args)
        if len(placements) != len(args):
            raise ValueError(
                f"prepare() got {len(args)} objects but device_placement has {len(placements)} entries; "
                "give one entry per object."
            )
        # Models first (a sharding backend re-binds optimizers to their parameters), schedulers last
        # (they need the prepared optimizers).
        first = list(args)
        for index in sorted(range(len(args)), key=lambda i: not isinstance(args[i], nn.Module)):
            first[index] = self._prepare_one(args[index], placements[index])
        result = [self._prepare_scheduler_if_any(obj) for obj in first]
        return result[0] if len(result) == 1 else tuple(result)

    def _prepare_one(self, obj: Any, placement: bool | None) -> Any:
        if isinstance(obj, DataLoader):
            return self.prepare_data_loader(obj, device_placement=placement)
        if isinstance(obj, nn.Module):
            return self.prepare_model(obj, device_placement=placement)
        if isinstance(obj, torch.optim.Optimizer):
            return self.prepare_optimizer(obj, device_placement=placement)
        return obj

    def _prepare_scheduler_if_any(self, obj: Any) -> Any:
        if isinstance(obj, _LRScheduler) and not isinstance(obj, AcceleratedScheduler):
            return self.prepare_scheduler(obj)
        return obj

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """Place the model on the device, add autocast under mixed precision and wrap it for the backend.

        Args:
            model: the model.
            device_placement: override the Accelerator's ``device_placement`` for this model.
            evaluation_mode: skip the distributed wrapper (for models that are never trained).
        """
        if any(model is prepared for prepared in self._models):
            return model
        if any(model is self.unwrap_model(prepared, keep_fp32_wrapper=True) for prepared in self._models):
            raise RuntimeError(
                f"{type(model).__name__} was prepared already; use the object prepare() returned the first time."
            )
        placement = self.device_placement if device_placement is None else device_placement
        self.precision.wrap_forward(model)
        prepared = self.backend.prepare_model(
            model, device_placement=placement, evaluation_mode=evaluation_mode
        )
        self._models.append(prepared)
        return prepared

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> AcceleratedOptimizer:
        """Wrap an optimizer so that it steps only on synchronised, non-overflowing gradients."""
        if isinstance(optimizer, AcceleratedOptimizer):
            return optimizer
        placement = self.device_placement if device_placement is None else device_placement
        optimizer = self.backend.prepare_optimizer(optimizer)
        prepared = AcceleratedOptimizer(
            optimizer, placement, scaler=self.precision.scaler, device=self.device
        )
        self._optimizers.append(prepared)
        self._step_timer.watch(prepared)
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap an LR scheduler so that it follows the prepared optimizers (see ``lockstep.accelerator.scheduler``)."""
        if isinstance(scheduler, AcceleratedScheduler):
            return scheduler
        inner = getattr(scheduler, "optimizer", None)
        optimizers = [o for o in self._optimizers if inner is o or inner is o.optimizer] or self._optimizers
        prepared = AcceleratedScheduler(
            scheduler,
            optimizers,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches,
            num_processes=self.num_processes,
        )
        self._schedulers.append(prepared)
        return prepared

    def prepare_data_loader(
        self, data_loader: DataLoader, device_placement: bool | None = None
    ) -> DataLoader:
        """Shard a DataLoader across processes and move its batches to the device."""
        if data_loader in self._dataloaders:
            return data_loader
        config = self.settings.dataloader_config
        prepared = prepare_data_loader(
            data_loader,
            device=self.device,
            num_processes=self.num_processes,
            process_index=self.process_index,
            split_batches=config.split_batches,
            put_on_device=self.device_placement if device_placement is None else device_placement,
            rng_types=self.rng_types,
            dispatch_batches=config.dispatch_batches,
            even_batches=config.even_batches,
            use_seedable_sampler=config.use_seedable_sampler,
            data_seed=config.data_seed,
            non_blocking=config.non_blocking,
        )
        self._dataloaders.append(prepared)
        self._step_timer.watch(prepared)
        return prepared

    def skip_first_batches(self, dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
        """A loader that starts after ``num_batches`` batches of the current epoch."""
        return _skip_first_batches(dataloader, num_batches)

    # -- training step ----------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by the accumulation steps and scaled under fp16."""
        steps = self.gradient_accumulation_steps
        if steps > 1:
            loss = loss / steps
        with self._step_timer.backward():
            self.precision.backward(loss, **kwargs)

    def _do_sync(self) -> None:
        if self.gradient_state.sync_with_dataloader and self.gradient_state.end_of_dataloader:
            self.step = 0
            self.gradient_state._set_sync_gradients(True)
        else:
            self.step += 1
            self.gradient_state._set_sync_gradients(self.step % self.gradient_accumulation_steps == 0)

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
        self._do_sync()
        sync_anyway = self.use_distributed and self.gradient_state.sync_each_batch
        with contextlib.ExitStack() as stack:
            if not (self.sync_gradients or sync_anyway):
                for model in models:
                    stack.enter_context(self.backend.no_sync(model))
            yield

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A context in which backward passes of ``model`` do not all-reduce gradients."""
        return self.backend.no_sync(model)

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> contextlib.AbstractContextManager:
        """Run a block under this Accelerator's mixed precision (a no-op in full precision)."""
        return self.precision.autocast_context(autocast_handler)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer | Sequence[Any] | None = None) -> None:
        """Divide gradients by the fp16 loss scale (once per step; a no-op otherwise)."""
        if self.precision.scaler is None or not self.sync_gradients:
            return
        optimizers = self._optimizers if optimizer is None else optimizer
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

    # -- collectives ------------------------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        """Gather tensors (nested structures too) from every process, concatenated along dim 0."""
        return collectives.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather like :meth:`gather`, then drop the samples repeated to even out the last batch.

        Over a whole prepared evaluation loader, the gathered values are exactly the dataset's, in order,
        so metrics computed on them equal single-process metrics.
        """
        tensors_only = all(isinstance(x, torch.Tensor) for x in _flat_values(input_data))
        as_objects = use_gather_object or not tensors_only
        if as_objects:
            data = collectives.gather_object(input_data if isinstance(input_data, list) else [input_data])
        else:
            data = collectives.gather(input_data)
        if not self.gradient_state.end_of_dataloader:
            return data
        return collectives.gather_for_metrics_truncate(
            data, self.gradient_state.remainder, from_gather_object=as_objects
        )

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Reduce tensors across processes: ``"sum"``, ``"mean"`` or ``"none"`` (this rank's value)."""
        return collectives.reduce(tensor, reduction=reduction, scale=scale)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        """Pad tensors to the largest size in ``dim`` across processes."""
        return collectives.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def set_trigger(self) -> None:
        """Raise a flag on this process that :meth:`check_trigger` will see on every process."""
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """True on every process when any process called :meth:`set_trigger` (then resets the flag)."""
        if self.flag_tensor is None:
            self.flag_tensor = torch.tensor(0, device=self.device)
        flag = collectives.reduce(self.flag_tensor, reduction="sum")
        if int(flag.item()) >= 1:
            self.flag_tensor = torch.tensor(0, device=self.device)
            return True
        return False

    # -- memory and shutdown ----------------------------------------------------------------------
    def free_memory(self, *objects: Any) -> list[Any]:
        """Drop the Accelerator's references to prepared objects and free cached memory."""
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self.step = 0
        return release_memory(*objects)

    clear = free_memory

    def end_training(self) -> None:
        """Finish the run: close trackers, finish background saves, tear the process group down safely."""
        self._finish_trackers()
        self._checkpointing.wait()
        self.free_memory()
        _process_group.shutdown(barrier=True)
        hang_watchdog.stop()

    # -- saving -----------------------------------------------------------------------------------
    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """Save ``obj`` once per machine set-up (on the main process): torch.save or safetensors."""
        if not self.is_main_process:
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
        **kwargs: Any,
    ) -> str:
        """Save everything needed to resume exactly: weights, optimizers, schedulers, scaler, RNGs of every
        rank, dataloader positions, the accumulation position and registered objects.

        The save is crash-consistent: files go to a staging folder, a manifest is written last and the
        folder is renamed into place atomically. Returns the checkpoint folder. With ``async_save=True``
        training stops only while the state is copied to CPU memory; the files are written in the
        background and the next save (or :meth:`wait_for_checkpoint`) waits for them.
        ``last_save_report`` says how long training stalled.

        Example:
            >>> accelerator = Accelerator(project_config=ProjectConfiguration(  # doctest: +SKIP
            ...     project_dir="runs/a", automatic_checkpoint_naming=True, total_limit=3))
            >>> accelerator.save_state()  # runs/a/checkpoints/checkpoint_0  # doctest: +SKIP
        """
        with self._step_timer.checkpoint():
            return self._checkpointing.save_state(self, output_dir, safe_serialization, async_save)

    def wait_for_checkpoint(self) -> None:
        """Block until a background (``async_save=True``) checkpoint is written and committed."""
        with self._step_timer.checkpoint():
            self._checkpointing.wait()

    @property
    def last_save_report(self) -> Any:
        """Folder, training stall in seconds, bytes and mode of the last ``save_state`` (None before one)."""
        return self._checkpointing.last_save

    @property
    def step_stats(self) -> dict[str, float]:
        """The last optimizer step's time breakdown and rates (``Accelerator(step_timing=True)``).

        Keys: ``time/data``, ``time/forward_backward``, ``time/optimizer``, ``time/checkpoint``,
        ``time/other`` (they add up to ``time/step``), ``time/communication`` (DDP), ``samples_per_second``,
        ``tokens_per_second``, ``flops_per_second``, ``mfu`` (known GPUs); see ``lockstep.throughput``.
        """
        return self._step_timer.stats

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> None:
        """Restore a checkpoint written by :meth:`save_state`; prepared dataloaders continue at the next
        unseen batch. Without ``input_dir``, loads the newest valid checkpoint of the project."""
        self._checkpointing.load_state(self, input_dir)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and load these objects (anything with ``state_dict``/``load_state_dict``) with the state."""
        self._checkpointing.register(objects)

    def register_save_state_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """Call ``hook(models, weights, output_dir)`` before saving; it may pop weights it saved itself."""
        return self._checkpointing.add_hook(self._checkpointing.save_hooks, hook)

    def register_load_state_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """Call ``hook(models, input_dir)`` before loading; it may pop models it loaded itself."""
        return self._checkpointing.add_hook(self._checkpointing.load_hooks, hook)

    def save_model(
        self,
        model: nn.Module,
        save_directory: str,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write the unwrapped model as (sharded) safetensors plus an index, on the main process."""
        save_model(self, model, save_directory, max_shard_size, safe_serialization)

    # -- preemption and restarts -------------------------------------------------------------------
    @property
    def should_stop(self) -> bool:
        """True on every rank once any rank received a preemption signal (SIGTERM, SIGUSR1).

        Check it on every rank at the same point of the loop, after ``optimizer.step()``; the first check
        installs the signal handlers. It costs one small all-reduce per check.

        Example:
            >>> for batch in train_dataloader:  # doctest: +SKIP
            ...     ...
            ...     optimizer.step()
            ...     if accelerator.should_stop:
            ...         accelerator.checkpoint_and_exit()  # saves, then exits with 143
        """
        return self._preemption.should_stop(self.device)

    def checkpoint_and_exit(self, output_dir: str | None = None) -> None:
        """Save the state (as :meth:`save_state`), shut down cleanly and exit with ``128 + signal``."""
        started = time.monotonic()
        folder = self.save_state(output_dir)
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
        root = self._checkpointing.automatic_root(self)
        if root is None:
            raise ValueError(
                "resume_from_latest_checkpoint() needs Accelerator(project_dir=...) (checkpoints are looked for "
                "in project_dir/checkpoints)."
            )
        try:
            self.load_state()
        except FileNotFoundError:
            return None
        return str(root / f"checkpoint_{self.project_configuration.iteration - 1}")


def _flat_values(data: Any) -> list[Any]:
    if isinstance(data, dict):
        return [v for value in data.values() for v in _flat_values(value)]
    if isinstance(data, (list, tuple)):
        return [v for value in data for v in _flat_values(value)]
    return [data]
