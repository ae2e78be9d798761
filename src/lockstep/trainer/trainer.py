"""The Trainer: a training loop you configure instead of write, driving an Accelerator through its public API.

Example:
    >>> from lockstep import Trainer, TrainingArguments
    >>> args = TrainingArguments(output_dir="runs/a", num_train_epochs=1, learning_rate=3e-5)
    >>> trainer = Trainer(model, args, train_dataset=train, eval_dataset=held_out,  # doctest: +SKIP
    ...                   data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=accuracy)
    >>> trainer.train()  # doctest: +SKIP
    >>> trainer.evaluate()["eval_accuracy"]  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lockstep.backends import ConfiguredOptimizer
from lockstep.integrations.peft import gathered_adapter
from lockstep.progress import ProgressBar
from lockstep.trainer import (
    _best_model,
    _hyperparameter_search,
    _output_dir,
    _process_setup,
    _setup_checks,
    _trainer_parts,
    _trainer_reports,
    _transformers_format,
    batches,
)
from lockstep.trainer._evaluation import EvalPrediction, PredictionOutput
from lockstep.trainer._hyperparameter_search import BestRun
from lockstep.trainer._loaders import TrainerLoaders
from lockstep.trainer._logging import format_log_line
from lockstep.trainer._loss_sums import LossSums
from lockstep.trainer._num_items import MicroBatch
from lockstep.trainer._step_plan import StepPlan, plan_steps, record_plan, resized_plan
from lockstep.trainer._trainer_checkpoints import TrainerCheckpoints
from lockstep.trainer._training_step import training_step_for
from lockstep.trainer.arguments import TrainingArguments
from lockstep.trainer.callbacks import (
    CallbackHandler,
    DefaultFlowCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from lockstep.utils import clear_device_cache, find_batch_size, find_executable_batch_size, is_peft_model

if TYPE_CHECKING:
    from lockstep.trainer._trainer_parts import EvalLoopOutput

logger = logging.getLogger("lockstep.trainer")


class TrainOutput(NamedTuple):
    """What ``train`` returns."""

    global_step: int
    training_loss: float
    metrics: dict[str, float]


class Trainer:
    """Trains, evaluates and checkpoints a model on one or many processes.

    Args:
        model: a transformers model (the loss comes from ``outputs.loss``; labels travel in the batch) or any
            ``nn.Module`` together with ``compute_loss_func``.
        args: the run's :class:`TrainingArguments` (default: ``TrainingArguments()``).
        train_dataset: map-style (``__getitem__``/``__len__``: a torch ``Dataset``, a Hugging Face
            ``datasets.Dataset``) or iterable (a torch ``IterableDataset``, a ``datasets.IterableDataset``;
            then ``max_steps`` is required). With ``remove_unused_columns`` (the default) the columns of a
            ``datasets`` object that the model's forward does not accept are removed before loading.
        eval_dataset: examples for :meth:`evaluate` (the same kinds).
        data_collator: turns a list of examples into a batch (default: stacks dict or tuple examples).
        compute_metrics: ``fn(EvalPrediction) -> dict`` over the gathered predictions and labels.
        callbacks: :class:`TrainerCallback` instances or classes, called after the default flow callback.
        optimizers: ``(optimizer, lr_scheduler)`` to use instead of AdamW and the arguments' schedule; the
            scheduler is stepped once per optimizer step.
        compute_loss_func: ``fn(outputs, labels, num_items_in_batch=n) -> loss``; labels are taken out of the
            batch before the model is called.
        model_init: ``fn()`` or ``fn(trial)`` returning a new model: used when ``model`` is None, and for each
            trial of :meth:`hyperparameter_search`.
        processing_class: the tokenizer (or processor) saved with the model by :meth:`save_model` and in
            every checkpoint; ``tokenizer=`` is transformers 4's name of it.
        preprocess_logits_for_metrics: ``fn(logits, labels) -> logits`` applied to each evaluation batch
            before it is gathered (e.g. an argmax, so that the whole vocabulary's logits are not kept).
        optimizer_cls_and_kwargs: ``(optimizer class, its keyword arguments)``, built over the parameter
            groups instead of ``args.optim``.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        *,
        train_dataset: Dataset | IterableDataset | Any | None = None,
        eval_dataset: Dataset | Any | None = None,
        data_collator: Callable[[list[Any]], Any] | None = None,
        compute_metrics: Callable[[EvalPrediction], dict[str, Any]] | None = None,
        callbacks: list[TrainerCallback | type[TrainerCallback]] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        compute_loss_func: Callable[..., torch.Tensor] | None = None,
        model_init: Callable[..., nn.Module] | None = None,
        processing_class: Any | None = None,
        preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None,
        optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None,
        tokenizer: Any | None = None,
    ) -> None:
        model = _trainer_parts.given_model(model, model_init)
        self.model_init = model_init
        self.processing_class = _trainer_parts.processing_class_of(processing_class, tokenizer)
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self._inputs = {
            "train_dataset": train_dataset,
            "eval_dataset": eval_dataset,
            "data_collator": data_collator,
            "compute_metrics": compute_metrics,
            "callbacks": callbacks,
            "compute_loss_func": compute_loss_func,
        }
        self.args = _setup_checks.checked_arguments(
            args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            optimizers=optimizers,
            compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics,
        )
        self.model = model
        self.accelerator, self._neftune = _process_setup.set_up_process(self.args, model)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.data_collator = data_collator
        self.compute_metrics, self.compute_loss_func = compute_metrics, compute_loss_func
        self.label_names = self.args.label_names or batches.default_label_names(model)
        self._step = self._build_training_step(model, compute_loss_func)
        self._given_optimizers = (optimizers[0], optimizers[1])
        self.optimizer, self.lr_scheduler = optimizers
        self.model_wrapped: nn.Module | None = None
        self.callback_handler = CallbackHandler([DefaultFlowCallback, *(callbacks or [])])
        self.state = TrainerState(
            is_world_process_zero=self.accelerator.is_main_process,
            is_local_process_zero=self.accelerator.is_local_main_process,
            num_processes=self.accelerator.num_processes,
        )
        self.control = TrainerControl()
        self._loaders = self._build_loaders(model, data_collator)
        self._train_batch_size = self.args.per_device_train_batch_size
        self._updates_per_epoch: int | None = None
        self._num_epochs = 0
        self._plan: StepPlan | None = None
        self._epoch_shown = 0
        self._prepared = self._registered = False
        self._progress: ProgressBar | None = None
        self._losses = LossSums(self.accelerator.device, nan_inf_filter=self.args.logging_nan_inf_filter)
        self._checkpoints = self._build_checkpoints()
        self._step_learning_rate = 0.0
        self.control = self._event("on_init_end")

    def _build_training_step(
        self, model: nn.Module, compute_loss_func: Callable[..., torch.Tensor] | None
    ) -> Any:
        """The training step, plain or pipelined, chosen once."""
        return training_step_for(
            self.accelerator,
            model,
            self.args,
            label_names=self.label_names,
            compute_loss_func=compute_loss_func,
            # looked up at each call: a subclass, or code that sets trainer.compute_loss, may replace it
            compute_loss=lambda model, batch, **kwargs: self.compute_loss(model, batch, **kwargs),
        )

    def _build_checkpoints(self) -> TrainerCheckpoints:
        return TrainerCheckpoints(
            self.accelerator,
            self.args,
            self.state,
            self._losses,
            save_weights=lambda folder: self.save_model(str(folder)),
            load_weights=lambda folder: self._step.load_weights(self.model_wrapped, folder),
            write_state=lambda folder: _transformers_format.write_trainer_state(folder, self.state),
        )

    def _build_loaders(self, model: nn.Module, data_collator: Any) -> TrainerLoaders:
        keep = batches.columns_to_keep(model, self.label_names) if self.args.remove_unused_columns else None
        collate = batches.make_collator(
            model,
            data_collator,
            remove_unused_columns=self.args.remove_unused_columns,
            label_names=self.label_names,
        )
        input_name = getattr(model, "main_input_name", "input_ids")
        return TrainerLoaders(
            self.accelerator, self.args, collate=collate, keep_columns=keep, input_name=input_name
        )

    # -- set-up -----------------------------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        """The prepared (sharded) training loader."""
        if self.train_dataset is None:
            raise ValueError("Trainer.train() needs Trainer(train_dataset=...).")
        return self._loaders.train_loader(self.train_dataset, self._train_batch_size)

    def get_eval_dataloader(self, eval_dataset: Any | None = None) -> DataLoader:
        """The prepared evaluation loader of ``eval_dataset`` (default: the Trainer's), made once per dataset."""
        self._setup()
        return self._eval_loader(eval_dataset, "Trainer.get_eval_dataloader(eval_dataset=...)")

    def _eval_loader(self, dataset: Any, argument: str) -> DataLoader:
        """The prepared loader of ``dataset`` as ``argument`` names it; None means the Trainer's eval set."""
        if dataset is None:
            dataset, argument = self.eval_dataset, "Trainer(eval_dataset=...)"
        if dataset is None:
            raise ValueError(
                "Trainer.evaluate() needs an evaluation set: Trainer(eval_dataset=...) or evaluate(ds)."
            )
        return self._loaders.eval_loader(dataset, argument)

    @property
    def _train_loader(self) -> DataLoader | None:
        return self._loaders.train

    def _setup(self) -> None:
        """Prepare loaders, model, optimizer and scheduler once, in a fixed order (checkpoints rely on it)."""
        if self._prepared:
            return
        train = self.train_dataset is not None
        self._step.prepare_model(  # a pipeline traces its stages with the first batch
            self.train_dataset if train else self.eval_dataset,
            collate=self._loaders.collate,
            batch_size=self._train_batch_size if train else self.args.per_device_eval_batch_size,
        )
        if self.train_dataset is not None:
            self.get_train_dataloader()
            optimizer, scheduler = self._optimizer_and_scheduler(self._plan_steps())
            self.model_wrapped, self.optimizer, self.lr_scheduler = self.accelerator.prepare(
                self.model, optimizer, scheduler
            )
        else:
            self.model_wrapped = self.accelerator.prepare(self.model)
        if self.eval_dataset is not None:
            self._eval_loader(None, "Trainer(eval_dataset=...)")
        if not self._registered:
            self.accelerator.register_for_checkpointing(self.state)
            self.accelerator.register_save_state_pre_hook(self._write_transformers_files)
            if self.args.report_to:
                self.accelerator.init_trackers(self.args.run_name or "trainer", config=self.args.to_dict())
            self._registered = True
        self._prepared = True

    def _optimizer_and_scheduler(self, max_steps: int) -> tuple[Any, Any]:
        """The given optimizer and scheduler, else the Trainer's own (or those the backend's config declares:
        :class:`~lockstep.backends.ConfiguredOptimizer`, DeepSpeed's)."""
        warmup = self.args.warmup_steps_for(max_steps)

        def schedule(optimizer: Any) -> Any:
            return self.create_scheduler(max_steps, optimizer)

        optimizer, scheduler = self._given_optimizers
        configured = self.accelerator.capability(ConfiguredOptimizer)
        if optimizer is None and configured is not None:
            return configured.optimizer_and_scheduler(
                self.model,
                learning_rate=self.args.learning_rate,
                weight_decay=self.args.weight_decay,
                warmup_steps=warmup,
                max_steps=max_steps,
                build_optimizer=self.create_optimizer,
                build_scheduler=schedule,
            )
        optimizer = optimizer if optimizer is not None else self.create_optimizer()
        return optimizer, scheduler if scheduler is not None else schedule(optimizer)

    def _plan_steps(self, resumed: bool = False) -> int:
        """Plan the run's optimizer steps (per process) and record them in the state; returns max_steps.
        After a ``resumed`` load on another number of processes, the rest of its epoch (:func:`resized_plan`)."""
        _, replicas = _process_setup.data_parallel_share(self.accelerator)
        plan = plan_steps(self.args, self._train_loader, num_processes=replicas, dataset=self.train_dataset)
        if resumed and self._plan is not None:
            step, dataset = self.state.global_step, self.train_dataset
            plan = resized_plan(self.args, self._train_loader, self._plan, step, dataset) or plan
        self._plan = plan
        self._updates_per_epoch, self._num_epochs = plan.updates_per_epoch, plan.num_epochs
        record_plan(
            self.state,
            plan,
            self.args,
            batch_size=self._train_batch_size,
            num_processes=replicas,
        )
        return plan.max_steps

    # -- callbacks --------------------------------------------------------------------------------
    def _event(self, name: str, **kwargs: Any) -> TrainerControl:
        return self.callback_handler.call_event(
            name,
            self.args,
            self.state,
            self.control,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            train_dataloader=self._train_loader,
            **kwargs,
        )

    def add_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Add a callback (instance or class)."""
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> TrainerCallback | None:
        """Remove a callback and return it."""
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Remove a callback."""
        self.callback_handler.remove_callback(callback)

    # -- training ---------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Train; ``resume_from_checkpoint=True`` continues from the newest valid checkpoint of ``output_dir``,
        a path from that checkpoint (the data order, RNGs and accumulation continue exactly), or a checkpoint
        folder written by ``transformers.Trainer``.

        With ``auto_find_batch_size``, an out-of-memory error on any process restarts the run on every process
        with 0.9 times the per-device batch size (``find_executable_batch_size``); the weights are not reset.

        Example:
            >>> trainer.train(resume_from_checkpoint=True)  # doctest: +SKIP
        """
        if self.train_dataset is None:
            raise ValueError("Trainer.train() needs Trainer(train_dataset=...).")
        if resume_from_checkpoint is None:
            resume_from_checkpoint = self.args.resume_from_checkpoint
        if not self.args.auto_find_batch_size:
            return self._train(self._train_batch_size, resume_from_checkpoint)
        search = find_executable_batch_size(self._train, starting_batch_size=self._train_batch_size)
        return search(resume_from_checkpoint)

    def _train(self, batch_size: int, resume_from_checkpoint: str | bool | None) -> TrainOutput:
        if batch_size != self._train_batch_size:  # auto_find_batch_size: the last attempt ran out of memory
            logger.warning(
                "auto_find_batch_size: out of memory with per_device_train_batch_size=%d; retrying with %d.",
                self._train_batch_size,
                batch_size,
            )
            self._start_over(batch_size)
        self._setup()
        folder = self._checkpoints.resolve(resume_from_checkpoint)
        if folder is not None:
            self._resume(folder)
        return self._training_loop()

    def _start_over(self, batch_size: int) -> None:
        """Forget the prepared objects and the run's progress, to train again with ``batch_size``."""
        self.accelerator.free_memory()
        self._loaders.clear()
        self._prepared = False
        self._train_batch_size = batch_size
        self.model_wrapped = None
        self.optimizer, self.lr_scheduler = self._given_optimizers
        fresh = TrainerState(num_processes=self.accelerator.num_processes)
        self.state.load_state_dict(fresh.state_dict())  # the same object: the Accelerator saves it
        self._losses.reset()
        self.control = TrainerControl()

    def _resume(self, folder: Path | str) -> None:
        planned = self.state.max_steps
        # A checkpoint on object storage is a lockstep one (transformers' layout is read from local folders).
        if isinstance(folder, Path) and _transformers_format.is_transformers_checkpoint(folder):
            _setup_checks.check_transformers_resume(self.accelerator, folder)
            self._plan_steps()
            _transformers_format.resume_from_transformers(
                folder,
                model=self.accelerator.unwrap_model(self.model_wrapped, keep_torch_compile=False),
                optimizer=self.optimizer,
                scheduler=self.lr_scheduler,
                loader=self._train_loader,
                state=self.state,
                rank=self.accelerator.process_index,
                world_size=self.accelerator.num_processes,
                updates_per_epoch=self._updates_per_epoch,
                accumulation=self.args.gradient_accumulation_steps,
            )
        else:
            self._checkpoints.check_resumable(folder)
            self.accelerator.load_state(str(folder))
            _process_setup.follow_kept_global_batch(self.args, self.accelerator)
        saved_plan = self.state.max_steps
        self._plan_steps(resumed=True)
        if self._plan is not None and self._plan.resized is not None:
            logger.info(
                "%s was saved by a run of %d steps on another number of processes; on %d it ends at step %d.",
                folder,
                saved_plan,
                self.accelerator.num_processes,
                self.state.max_steps,
            )
        elif saved_plan != planned:
            logger.warning(
                "%s was saved by a run of %d steps; this run plans %d.", folder, saved_plan, planned
            )
        self._losses.restore(self.state)
        if self.args.restore_callback_states_from_checkpoint:
            self.control = _transformers_format.restore_callbacks(
                self.callback_handler, self.control, self.state.stateful_callbacks
            )
        self._print(f"[train] resumed from {folder} at step {self.state.global_step}/{self.state.max_steps}")

    def _training_loop(self) -> TrainOutput:
        args, accelerator, state = self.args, self.accelerator, self.state
        start_step, started = state.global_step, time.perf_counter()
        self._progress = ProgressBar(
            state.max_steps,
            enabled=accelerator.is_main_process and not args.disable_tqdm,
            initial=state.global_step,
        )
        self.control = self._event("on_train_begin")
        if args.eval_on_start:
            self.evaluate()
        samples = 0
        epoch = getattr(self._train_loader, "iteration", 0)
        try:
            while epoch < self._num_epochs and state.global_step < state.max_steps:
                samples += self._train_epoch(epoch)
                if self.control.should_training_stop:
                    break
                epoch += 1
        finally:
            self._progress.close()
        return self._finish_training(start_step, samples, time.perf_counter() - started)

    def _train_epoch(self, epoch: int) -> int:
        """One pass over the training loader (the rest of it, after a resume); returns samples trained on."""
        accelerator, model = self.accelerator, self.model_wrapped
        assert model is not None and self._train_loader is not None
        self._epoch_shown = epoch + 1
        self.control.should_epoch_stop = False
        self.control = self._event("on_epoch_begin")
        model.train()
        micro, samples, step_samples, step_loss = 0, 0, 0, torch.zeros((), device=accelerator.device)
        tokens = torch.zeros((), dtype=torch.int64, device=accelerator.device)
        _, replicas = _process_setup.data_parallel_share(accelerator)
        steps = self.args.gradient_accumulation_steps
        if hasattr(
            self._train_loader, "set_epoch"
        ):  # as transformers does; a healed replica group meets here
            self._train_loader.set_epoch(epoch)
        for micro_batch in self._step.micro_batches(self._train_loader, steps):
            batch = micro_batch.batch
            if micro == 0:
                self.control._new_step()
                self.control = self._event("on_step_begin")
                step_loss.zero_()
                step_samples = 0
            loss, grad_norm = self._training_step(model, micro_batch)
            if self.args.include_num_input_tokens_seen != "no":
                tokens += batches.input_tokens(batch, self.args.include_num_input_tokens_seen).to(
                    tokens.device
                )
            micro += 1
            step_loss += loss
            step_samples += (find_batch_size(batch) or 0) * replicas
            if not accelerator.sync_gradients:
                self.control = self._event("on_substep_end")
                continue
            samples += step_samples
            if self.args.include_num_input_tokens_seen != "no":
                self.state.num_input_tokens_seen += int(accelerator.reduce(tokens, reduction="sum"))
                tokens.zero_()
            # A counted loss is already the step's share (transformers sums it); a per-batch mean is averaged.
            counted = micro_batch.num_items is not None
            self._after_optimizer_step(step_loss if counted else step_loss / micro, grad_norm, step_samples)
            micro = 0
            if self.control.should_training_stop or self.control.should_epoch_stop:
                break
            if accelerator.should_stop:  # a preemption signal reached some rank: all stop at this step
                if self._progress is not None:
                    self._progress.close()
                self.state.stateful_callbacks = _transformers_format.export_callback_states(
                    self.callback_handler, self.control
                )
                self._checkpoints.save_and_exit()
        self.control = self._event("on_epoch_end")
        self._maybe_log_save_evaluate(grad_norm=None)
        return samples

    def _training_step(
        self, model: nn.Module, micro_batch: MicroBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward, backward and (on the last micro-batch) clip, optimizer and scheduler steps.

        Returns the (undivided) loss of the batch and, on the last micro-batch, the gradient norm."""
        accelerator, grad_norm = self.accelerator, None
        with self._step.accumulating(model, micro_batch):
            loss = self.training_step(model, micro_batch.batch, micro_batch.num_items)
            if accelerator.sync_gradients:
                if self.args.max_grad_norm:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)
                self.control = self._event("on_pre_optimizer_step")
            self.optimizer.step()  # type: ignore[union-attr]
            if accelerator.sync_gradients:
                self.control = self._event("on_optimizer_step")
                # The rate this step used (logged as transformers 5 does, before the scheduler moves on).
                self._step_learning_rate = float(self.lr_scheduler.get_last_lr()[0])
                if not accelerator.optimizer_step_was_skipped and not self._steps_on_metric():
                    self.lr_scheduler.step()
            self.optimizer.zero_grad()  # type: ignore[union-attr]
        return loss.detach(), grad_norm

    def compute_loss(
        self,
        model: nn.Module,
        inputs: Any,
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | None = None,
    ) -> Any:
        """The loss of one batch: ``outputs.loss``, or ``compute_loss_func(outputs, labels, ...)``;
        ``num_items_in_batch`` (the label tokens of the accumulation cycle) goes to both. With
        ``return_outputs``: ``(loss, outputs)``."""
        return self._step.loss(model, inputs, num_items_in_batch, return_outputs=return_outputs)

    def _after_optimizer_step(
        self, step_loss: torch.Tensor, grad_norm: torch.Tensor | None, samples: int
    ) -> None:
        state = self.state
        state.global_step += 1
        empty_every = self.args.torch_empty_cache_steps
        if empty_every and state.global_step % empty_every == 0:
            clear_device_cache()
        if self._updates_per_epoch and self._plan is not None:
            state.epoch = self._plan.epoch_at(state.global_step)
        else:
            state.epoch = float(self._epoch_shown - 1)
        self._losses.add(step_loss, state.steps_since_log)
        state.steps_since_log += 1
        assert self._progress is not None
        self._progress.update(1, samples=samples)
        self.control = self._event("on_step_end")
        self._maybe_log_save_evaluate(grad_norm=grad_norm)

    def _maybe_log_save_evaluate(self, grad_norm: torch.Tensor | None) -> None:
        control, state = self.control, self.state
        if control.should_log and state.steps_since_log > 0:
            logs: dict[str, Any] = {
                "loss": self._losses.take_log_mean(self.accelerator, state.steps_since_log),
                "learning_rate": self._step_learning_rate,
            }
            if grad_norm is not None:
                logs["grad_norm"] = float(grad_norm)
            if self.args.include_num_input_tokens_seen != "no":
                logs["num_input_tokens_seen"] = state.num_input_tokens_seen
            state.steps_since_log = 0
            self.log(logs)
        control.should_log = False
        if control.should_evaluate:
            control.should_evaluate = False
            is_new_best = self._after_evaluation(self.evaluate())
            if self.args.save_strategy == "best":
                control.should_save = is_new_best
        if control.should_save:
            control.should_save = False
            self._save_checkpoint()

    def _finish_training(self, start_step: int, samples: int, seconds: float) -> TrainOutput:
        state = self.state
        train_loss = self._losses.train_loss(self.accelerator, state.global_step)
        steps = state.global_step - start_step
        metrics = {
            "train_runtime": round(seconds, 4),
            "train_samples_per_second": round(samples / max(seconds, 1e-9), 3),
            "train_steps_per_second": round(steps / max(seconds, 1e-9), 3),
            "train_loss": train_loss,
        }
        self.log(metrics)
        if self.args.load_best_model_at_end and state.best_model_checkpoint is not None:
            folder = self._checkpoints.load_best()
            self._print(
                f"[train] loaded the best model from {folder} ({_best_model.metric_key(self.args)}="
                f"{state.best_metric:.6g})"
            )
        self.control = self._event("on_train_end")
        return TrainOutput(global_step=state.global_step, training_loss=train_loss, metrics=metrics)

    # -- checkpoints ------------------------------------------------------------------------------
    def _save_checkpoint(self) -> Path | str:
        self.state.stateful_callbacks = _transformers_format.export_callback_states(
            self.callback_handler, self.control
        )
        folder = self._checkpoints.save()
        self.control = self._event("on_save", checkpoint=str(folder))
        return folder

    def _write_transformers_files(self, models: list[nn.Module], weights: list[Any], output_dir: str) -> None:
        """Save hook: ``trainer_state.json`` and the model's ``config.json`` beside lockstep's files; for a
        peft model, peft's adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) instead of
        the config, as transformers.Trainer writes it into ``checkpoint-<step>``."""
        writes = self.accelerator.is_main_process or (
            self.args.save_on_each_node and self.accelerator.is_local_main_process
        )
        unwrapped = self.accelerator.unwrap_model(self.model_wrapped, keep_torch_compile=False)
        adapter = None
        if weights and is_peft_model(unwrapped):  # weights[0]: the adapter, or None when saved as shards
            adapter = weights[0] if weights[0] is not None else gathered_adapter(unwrapped)  # a collective
        if not writes:
            return
        folder = Path(output_dir)
        _transformers_format.write_trainer_state(folder, self.state)
        _trainer_reports.save_processing_class(self, folder)
        if adapter is not None:
            unwrapped.save_pretrained(str(folder), state_dict=adapter, safe_serialization=True)
        elif weights and weights[0] is not None:  # model.safetensors goes to the folder: add its config
            _transformers_format.write_model_config(folder, unwrapped)

    # -- best model -------------------------------------------------------------------------------
    def _steps_on_metric(self) -> bool:
        """Whether the scheduler is stepped with the evaluated metric (ReduceLROnPlateau), not per step."""
        scheduler = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)
        return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def _after_evaluation(self, metrics: dict[str, float]) -> bool:
        """Step a plateau schedule with the metric; record the best. Returns whether this one is the best."""
        if self._steps_on_metric():
            self.lr_scheduler.step(_best_model.metric_value(self.args, metrics))
        return _best_model.update_best(self.args, self.state, metrics)

    # -- hyperparameter search ------------------------------------------------------------------
    def hyperparameter_search(
        self,
        hp_space: Callable[[Any], dict[str, Any]] | None = None,
        compute_objective: Callable[[dict[str, float]], Any] | None = None,
        n_trials: int = 20,
        direction: str | list[str] = "minimize",
        backend: str | None = None,
        hp_name: Callable[[Any], str] | None = None,
        **kwargs: Any,
    ) -> BestRun | list[BestRun]:
        """Search hyperparameters with Optuna: ``n_trials`` runs, each with the arguments ``hp_space(trial)``
        returns and a model from ``model_init``; the objective is ``compute_objective(metrics)`` of the last
        evaluation (default: ``eval_loss``, or the sum of the ``compute_metrics`` results). Evaluations during
        training are reported to Optuna, whose pruner may stop a trial. Every process returns the best run.

        ``kwargs`` go to ``optuna.create_study`` (``sampler``, ``pruner``, ``study_name``, ``storage``...),
        except ``timeout`` and ``catch``, which go to ``study.optimize``.

        Example:
            >>> def space(trial):  # doctest: +SKIP
            ...     return {"learning_rate": trial.suggest_float("learning_rate", 1e-5, 1e-3, log=True)}
            >>> best = trainer.hyperparameter_search(space, n_trials=10, direction="minimize")  # doctest: +SKIP
            >>> best.hyperparameters["learning_rate"]  # doctest: +SKIP
        """
        return _hyperparameter_search.search(
            self,
            hp_space=hp_space,
            compute_objective=compute_objective,
            n_trials=n_trials,
            direction=direction,
            backend=backend,
            hp_name=hp_name,
            study_kwargs=kwargs,
        )

    # -- evaluation -------------------------------------------------------------------------------
    def evaluate(
        self,
        eval_dataset: Any | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Evaluate on ``eval_dataset`` (default: the Trainer's); metrics equal a one-process evaluation.

        Returns ``{prefix}_loss`` (when the model gives a loss), the ``compute_metrics`` results prefixed,
        and timings.
        """
        self._setup()
        loader = self._eval_loader(eval_dataset, "Trainer.evaluate(eval_dataset=...)")
        output = _trainer_parts.run_evaluation(self, loader, metric_key_prefix, ignore_keys=ignore_keys)
        self.log(output.metrics)
        self.control = self._event("on_evaluate", metrics=output.metrics)
        return output.metrics

    def predict(
        self, test_dataset: Any, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test"
    ) -> PredictionOutput:
        """Predictions (NumPy, one row per example, in dataset order), labels and metrics on ``test_dataset``."""
        self._setup()
        if test_dataset is None:
            raise ValueError("Trainer.predict(test_dataset=...) needs a dataset; got None.")
        output = _trainer_parts.run_evaluation(
            self,
            self._eval_loader(test_dataset, "Trainer.predict(test_dataset=...)"),
            metric_key_prefix,
            predict=True,
            ignore_keys=ignore_keys,
        )
        self.control = self._event("on_predict", metrics=output.metrics)
        return output

    # -- logging and saving -----------------------------------------------------------------------
    def log(self, logs: dict[str, float]) -> None:
        """Record ``logs`` in ``state.log_history``, print one line (main process), send them to the trackers
        (``report_to``) and call ``on_log``.

        As transformers' ``log``, it adds ``epoch`` to ``logs`` itself: the metrics that ``train()`` and
        ``evaluate()`` return (and an ``evaluate`` override passes here) carry it, so a script's
        ``save_metrics`` writes it.
        """
        state = self.state
        if state.max_steps > 0 and "epoch" not in logs:
            logs["epoch"] = round(state.epoch, 4)
        state.log_history.append({**logs, "step": state.global_step})
        self.control = self._event("on_log", logs=logs)
        if self.accelerator.is_main_process:
            epoch = self._epoch_shown or max(1, math.ceil(state.epoch))
            line = format_log_line(
                logs,
                epoch=epoch,
                num_epochs=self._num_epochs,
                step=state.global_step,
                max_steps=state.max_steps,
            )
            self._print(line)
        self.accelerator.log(logs, step=state.global_step)

    def _print(self, line: str) -> None:
        if not self.accelerator.is_main_process:
            return
        if self._progress is not None:
            self._progress.write(line)
        else:
            print(line, flush=True)

    def save_model(self, output_dir: str | None = None) -> None:
        """Write the trained model (unwrapped) to ``output_dir`` (default: ``args.output_dir``).

        transformers models are written with ``save_pretrained`` (config included, so ``from_pretrained``
        reads the folder); other modules as safetensors. The arguments go to ``training_args.json``.
        """
        main = self.accelerator.is_main_process
        with _output_dir.writable(output_dir or self.args.output_dir, upload=main) as folder:  # URLs too
            model = self.model_wrapped if self.model_wrapped is not None else self.model
            self._step.save_weights(model, folder)
            if main:
                (folder / "training_args.json").write_text(
                    json.dumps(self.args.to_dict(), indent=1, default=str)
                )
                _trainer_reports.save_processing_class(self, folder)
        self.accelerator.wait_for_everyone()

    # -- transformers' public methods beyond the loop (_trainer_parts, _trainer_reports) ----------------
    def training_step(
        self, model: nn.Module, inputs: Any, num_items_in_batch: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch (through :meth:`compute_loss`); returns the detached loss.
        The Trainer's loop calls it inside its accumulation context, then clips and steps the optimizer."""
        return _trainer_parts.training_step(self, model, inputs, num_items_in_batch)

    def prediction_step(
        self,
        model: nn.Module,
        inputs: Any,
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, Any, Any]:
        """``(loss, logits, labels)`` of one batch without gradients; ``(loss, None, None)`` with
        ``prediction_loss_only``. With labels the loss and outputs come from :meth:`compute_loss` (a subclass's
        override included), as in transformers. Output keys in ``ignore_keys`` are left out of the logits."""
        return _trainer_parts.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)

    def evaluation_loop(
        self,
        dataloader: DataLoader,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        """Predictions, labels, metrics (``compute_metrics`` included) and the number of examples of a prepared
        loader (from :meth:`get_eval_dataloader`); ``description`` is transformers' label of the run."""
        self._setup()
        output = _trainer_parts.run_evaluation(
            self,
            dataloader,
            metric_key_prefix,
            prediction_loss_only=prediction_loss_only,
            ignore_keys=ignore_keys,
        )
        return _trainer_parts.EvalLoopOutput(
            output.predictions, output.label_ids, output.metrics, self.num_examples(dataloader)
        )

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The optimizer given to the Trainer, else ``args.optim`` over the trainable parameters (built once)."""
        return _trainer_parts.create_optimizer(self, model)

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        """The scheduler given to the Trainer, else ``args.lr_scheduler_type`` over ``num_training_steps``."""
        return _trainer_parts.create_scheduler(self, num_training_steps, optimizer)

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        """:meth:`create_optimizer`, then :meth:`create_scheduler` over it."""
        _trainer_parts.create_optimizer_and_scheduler(self, num_training_steps)

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:
        """The prepared loader of ``test_dataset`` (made once per dataset)."""
        return _trainer_parts.get_test_dataloader(self, test_dataset)

    def num_examples(self, dataloader: DataLoader) -> int:
        """Examples in a loader's dataset (loader length x batch size for a dataset without a length)."""
        return _trainer_parts.num_examples(self, dataloader)

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        """Parameters that get weight decay: all but biases and normalization-layer weights."""
        return _trainer_parts.get_decay_parameter_names(self, model)

    def get_num_trainable_parameters(self) -> int:
        """The number of parameters of the model that require gradients."""
        return _trainer_parts.get_num_trainable_parameters(self)

    def get_learning_rates(self) -> list[float]:
        """The learning rate of each parameter group."""
        return _trainer_parts.get_learning_rates(self)

    def get_optimizer_group(self, param: str | nn.Parameter | None = None) -> Any:
        """The parameter group holding ``param`` (a parameter, or its name); every group's params without one."""
        return _trainer_parts.get_optimizer_group(self, param)

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """Examples per optimizer step over the whole job (data-parallel replicas x accumulation x batch)."""
        return _trainer_parts.get_total_train_batch_size(self, args)

    def floating_point_ops(self, inputs: Any) -> int:
        """The model's ``floating_point_ops(inputs)`` estimate (transformers models), else 0."""
        return _trainer_parts.floating_point_ops(self, inputs)

    def get_tp_size(self) -> int:
        """The tensor-parallel size: the model's ``tp_size``, else the ``ParallelismConfig``'s, else 1."""
        return _trainer_parts.get_tp_size(self)

    def get_cp_size(self) -> int:
        """The number of context-parallel shards each sequence is split into (1 without context parallelism)."""
        return _trainer_parts.get_cp_size(self)

    def get_sp_size(self) -> int:
        """1: lockstep splits sequences with context parallelism only (see :meth:`get_cp_size`)."""
        return _trainer_parts.get_sp_size(self)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """A new model from ``model_init`` (``model_init()`` or ``model_init(trial)``)."""
        return _trainer_parts.call_model_init(self, trial)

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> Any:
        """The mixed-precision autocast of the run (``bf16``/``fp16``); a no-op context without one."""
        return _trainer_parts.autocast_smart_context_manager(self, cache_enabled)

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        """The context the loss is computed in: the run's autocast."""
        return _trainer_parts.compute_loss_context_manager(self)

    def end(self) -> None:
        """Finish the trackers and destroy the process group: the last call of a script."""
        _trainer_parts.end(self)

    @property
    def model_accepts_loss_kwargs(self) -> bool:
        """Whether the model's forward takes ``num_items_in_batch`` (it then normalizes its own loss by it)."""
        return _trainer_parts.model_accepts_loss_kwargs(self)

    def is_world_process_zero(self) -> bool:
        """Whether this is the job's first process (the one that writes)."""
        return _trainer_reports.is_world_process_zero(self)

    def is_local_process_zero(self) -> bool:
        """Whether this is its machine's first process."""
        return _trainer_reports.is_local_process_zero(self)

    @staticmethod
    def metrics_format(metrics: dict[str, float]) -> dict[str, Any]:
        """Metrics for reading, as transformers prints them: runtimes as ``h:mm:ss.cc``, floats to 4 digits,
        memory in MB and ``total_flos`` in GF.

        Example:
            >>> from lockstep import Trainer
            >>> Trainer.metrics_format({"train_runtime": 61.5, "train_loss": 0.123456})
            {'train_runtime': '0:01:01.50', 'train_loss': 0.1235}
        """
        return _trainer_reports.metrics_format(metrics)

    def log_metrics(self, split: str, metrics: dict[str, float]) -> None:
        """Print ``metrics`` as an aligned ``***** {split} metrics *****`` table (first process only)."""
        _trainer_reports.log_metrics(self, split, metrics)

    def save_metrics(self, split: str, metrics: dict[str, float], combined: bool = True) -> None:
        """Write ``output_dir/{split}_results.json``; with ``combined`` also merge them into ``all_results.json``."""
        _trainer_reports.save_metrics(self, split, metrics, combined)

    def save_state(self) -> None:
        """Write ``output_dir/trainer_state.json`` in transformers' format (``save_model`` writes only the model)."""
        _trainer_reports.save_state(self)

    def create_model_card(
        self,
        language: str | None = None,
        license: str | None = None,  # transformers' parameter name
        tags: str | list[str] | None = None,
        model_name: str | None = None,
        finetuned_from: str | None = None,
        tasks: str | list[str] | None = None,
        dataset_tags: str | list[str] | None = None,
        dataset: str | list[str] | None = None,
        dataset_args: str | list[str] | None = None,
    ) -> None:
        """Write ``output_dir/README.md``: a model card with the metadata given, the hyperparameters, the
        evaluation results of ``state.log_history`` and the library versions (no network access).

        Example:
            >>> trainer.create_model_card(model_name="tiny-clm", dataset="wikitext", tags=["clm"])  # doctest: +SKIP
        """
        _trainer_reports.create_model_card(
            self,
            language,
            license,
            tags,
            model_name,
            finetuned_from,
            tasks,
            dataset_tags,
            dataset,
            dataset_args,
        )

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs: Any,
    ) -> NoReturn:
        """Refused: raises ``NotImplementedError`` (lockstep works offline; upload ``output_dir`` yourself)."""
        return _trainer_reports.push_to_hub(
            self, commit_message, blocking, token, revision, private, **kwargs
        )

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> NoReturn:
        """Refused: raises ``NotImplementedError`` (lockstep does not create Hub repositories)."""
        return _trainer_reports.init_hf_repo(self, token, private)
