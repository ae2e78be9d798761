"""transformers' overridable Trainer steps and accessors, as functions of the Trainer bound in its class body.

The loop calls them through the instance, so a subclass that overrides one, as transformers' examples do
(``compute_loss``, ``training_step``, ``prediction_step``, ``create_optimizer``, ``create_scheduler``),
changes what the Trainer does:

- ``training_step(model, inputs, num_items_in_batch)``: forward and backward of one micro-batch;
- ``prediction_step(model, inputs, prediction_loss_only, ignore_keys)``: ``(loss, logits, labels)`` of one
  evaluation batch through ``compute_loss``; when a subclass overrides either (or ``ignore_keys`` is given),
  ``evaluate`` and ``predict`` use it for every batch (the even_batches filler of the last batch is then
  dropped from the predictions, not from the loss);
- ``evaluation_loop(dataloader, description, ...)``: the loop ``evaluate`` runs, with ``num_samples``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.data import DataLoader

from lockstep.trainer import _evaluation, _hyperparameter_search, _process_setup, batches
from lockstep.trainer._evaluation import EvalOptions, PredictionOutput
from lockstep.trainer._num_items import MicroBatch
from lockstep.trainer.optimizers import create_optimizer as build_optimizer
from lockstep.trainer.optimizers import decay_parameter_names, parameter_groups
from lockstep.trainer.schedules import get_scheduler

# The Trainer and its arguments, typed loosely: trainer.py binds these functions, so importing it here (even
# for type checking) would be an import cycle.
Trainer = Any
TrainingArguments = Any


class EvalLoopOutput(NamedTuple):
    """What :meth:`Trainer.evaluation_loop` returns (transformers' fields)."""

    predictions: Any
    label_ids: Any
    metrics: dict[str, float]
    num_samples: int | None


# -- training -------------------------------------------------------------------------------------------
def training_step(
    self: Trainer, model: nn.Module, inputs: Any, num_items_in_batch: torch.Tensor | None = None
) -> torch.Tensor:
    """``Trainer.training_step``: forward and backward of one micro-batch (see there)."""
    micro_batch = MicroBatch(inputs, num_items_in_batch, last=self.accelerator.sync_gradients)
    return self._step.forward_backward(model, micro_batch).detach()


def create_optimizer(self: Trainer, model: nn.Module | None = None) -> torch.optim.Optimizer:
    """The optimizer given to the Trainer, else ``args.optim`` over the trainable parameters (built once)."""
    model = model if model is not None else self.model
    if self.optimizer is None and self.optimizer_cls_and_kwargs is not None:
        optimizer_cls, kwargs = self.optimizer_cls_and_kwargs
        self.optimizer = optimizer_cls(parameter_groups(model, self.args.weight_decay), **kwargs)
    elif self.optimizer is None:
        self.optimizer = build_optimizer(model, self.args)
    return self.optimizer


def create_scheduler(
    self: Trainer, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
) -> Any:
    """The scheduler given to the Trainer, else ``args.lr_scheduler_type`` over ``num_training_steps``."""
    if self.lr_scheduler is None:
        optimizer = optimizer if optimizer is not None else self.optimizer
        warmup = self.args.get_warmup_steps(num_training_steps)
        self.lr_scheduler = get_scheduler(
            self.args.lr_scheduler_type, optimizer, warmup, num_training_steps, self.args.lr_scheduler_kwargs
        )
    return self.lr_scheduler


def create_optimizer_and_scheduler(self: Trainer, num_training_steps: int) -> None:
    """:meth:`create_optimizer`, then :meth:`create_scheduler` over it."""
    self.create_optimizer()
    self.create_scheduler(num_training_steps=num_training_steps, optimizer=self.optimizer)


def get_decay_parameter_names(self: Trainer, model: nn.Module) -> list[str]:
    """Parameters that get weight decay: all but biases and normalization-layer weights."""
    return decay_parameter_names(model)


def get_num_trainable_parameters(self: Trainer) -> int:
    return sum(p.numel() for p in self.model.parameters() if p.requires_grad)


def _optimizer_or_fail(self: Trainer) -> torch.optim.Optimizer:
    if self.optimizer is None:
        raise ValueError(
            "The Trainer has no optimizer yet: it is built when training starts. Call trainer.create_optimizer() "
            "first, or pass Trainer(optimizers=(optimizer, None))."
        )
    return self.optimizer


def get_learning_rates(self: Trainer) -> list[float]:
    """The learning rate of each parameter group."""
    return [group["lr"] for group in _optimizer_or_fail(self).param_groups]


def get_optimizer_group(self: Trainer, param: str | nn.Parameter | None = None) -> Any:
    """The parameter group holding ``param`` (a parameter, or its name); every group's params without one."""
    groups = _optimizer_or_fail(self).param_groups
    if param is None:
        return [group["params"] for group in groups]
    if isinstance(param, str):
        param = dict(self.model.named_parameters())[param]
    for group in groups:
        if any(p is param for p in group["params"]):
            return group
    return None


def get_total_train_batch_size(self: Trainer, args: TrainingArguments) -> int:
    """Examples per optimizer step over the whole job (data-parallel replicas x accumulation x batch)."""
    _, replicas = _process_setup.data_parallel_share(self.accelerator)
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * replicas


def floating_point_ops(self: Trainer, inputs: Any) -> int:
    """The model's ``floating_point_ops(inputs)`` estimate (transformers models), else 0."""
    estimate = getattr(self.model, "floating_point_ops", None)
    return int(estimate(inputs)) if callable(estimate) else 0


def get_tp_size(self: Trainer) -> int:
    config = self.accelerator.parallelism_config
    return getattr(self.model, "tp_size", None) or (config.tp_size if config is not None else 1)


def get_cp_size(self: Trainer) -> int:
    return _process_setup.sequence_shards(self.accelerator)


def get_sp_size(self: Trainer) -> int:
    """1: lockstep splits sequences with context parallelism only (see :meth:`get_cp_size`)."""
    return 1


def call_model_init(self: Trainer, trial: Any = None) -> nn.Module:
    """A new model from ``model_init`` (``model_init()`` or ``model_init(trial)``)."""
    if self.model_init is None:
        raise RuntimeError("Trainer.call_model_init() needs Trainer(model_init=fn) returning a model.")
    return _hyperparameter_search.call_model_init(self.model_init, trial)


def autocast_smart_context_manager(self: Trainer, cache_enabled: bool | None = True) -> Any:
    """The mixed-precision autocast of the run (``bf16``/``fp16``); a no-op context without one."""
    return self.accelerator.autocast()


def compute_loss_context_manager(self: Trainer) -> contextlib.ExitStack:
    """The context the loss is computed in: the run's autocast."""
    stack = contextlib.ExitStack()
    stack.enter_context(self.autocast_smart_context_manager())
    return stack


def model_accepts_loss_kwargs(self: Trainer) -> bool:
    """Whether the model's forward takes ``num_items_in_batch`` (it then normalizes its own loss by it)."""
    from lockstep.trainer._num_items import accepts_loss_kwargs

    return accepts_loss_kwargs(self.model)


def end(self: Trainer) -> None:
    """Finish the trackers and destroy the process group: the last call of a script."""
    from lockstep.state import PartialState

    self.accelerator.end_training()
    PartialState().destroy_process_group()


# -- evaluation -----------------------------------------------------------------------------------------
def get_test_dataloader(self: Trainer, test_dataset: Any) -> DataLoader:
    """The prepared loader of ``test_dataset`` (made once per dataset)."""
    self._setup()
    return self._eval_loader(test_dataset, "Trainer.get_test_dataloader(test_dataset=...)")


def num_examples(self: Trainer, dataloader: DataLoader) -> int:
    """Examples in a loader's dataset (loader length x batch size for a dataset without a length)."""
    dataset = getattr(dataloader, "dataset", None)
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return len(dataloader) * (getattr(dataloader, "batch_size", None) or 1)


def prediction_step(
    self: Trainer,
    model: nn.Module,
    inputs: Any,
    prediction_loss_only: bool,
    ignore_keys: list[str] | None = None,
) -> tuple[torch.Tensor | None, Any, Any]:
    """``Trainer.prediction_step``: ``(loss, logits, labels)`` of one batch without gradients (see there)."""
    labels = batches.split_labels(inputs, self.label_names, pop=False)[1]  # before compute_loss may pop them
    with torch.no_grad():
        if labels is not None:
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        else:
            loss, outputs = None, batches.call_model(model, inputs)
    loss = loss.detach().mean() if loss is not None else None
    if prediction_loss_only:
        return loss, None, None
    if ignore_keys and isinstance(outputs, Mapping):
        outputs = {key: value for key, value in outputs.items() if key not in ignore_keys}
    return loss, batches.predictions_of(outputs), labels


def _lockstep_defines(self: Trainer, name: str) -> bool:
    """Whether the method ``name`` of this Trainer is lockstep's own (not a subclass's override)."""
    owner = next(cls for cls in type(self).__mro__ if name in vars(cls))
    return owner.__module__.startswith("lockstep.trainer.")


def run_evaluation(
    self: Trainer,
    loader: DataLoader,
    prefix: str,
    predict: bool = False,
    prediction_loss_only: bool | None = None,
    ignore_keys: list[str] | None = None,
) -> PredictionOutput:
    """The evaluation loop over a prepared loader, with the Trainer's options (and its overrides)."""
    assert self.model_wrapped is not None
    loss_only = self.args.prediction_loss_only if prediction_loss_only is None else prediction_loss_only
    options = EvalOptions.from_arguments(
        self.args, main_input_name=getattr(self.model, "main_input_name", "input_ids"), predict=predict
    )
    options = dataclasses.replace(options, preprocess_logits=self.preprocess_logits_for_metrics)
    step = None
    overridden = not _lockstep_defines(self, "prediction_step") or not _lockstep_defines(self, "compute_loss")
    generate = None
    if overridden or ignore_keys:  # a subclass's prediction_step or compute_loss, or output keys to drop

        def step(model: nn.Module, batch: Any) -> tuple[Any, Any, Any]:
            return self.prediction_step(model, batch, loss_only, ignore_keys=ignore_keys)

    elif getattr(self.args, "predict_with_generate", False) and not loss_only:  # the Seq2SeqTrainer's
        generate = self._generated_predictions
    return _evaluation.evaluation_loop(
        self.accelerator,
        self.model_wrapped,
        loader,
        label_names=self.label_names,
        compute_loss_func=self._step.loss_func,
        compute_metrics=self.compute_metrics,
        prediction_loss_only=loss_only,
        metric_key_prefix=prefix,
        options=options,
        prediction_step=step,
        generate=generate,
    )


def processing_class_of(processing_class: Any, tokenizer: Any) -> Any:
    """``processing_class``, or transformers 4's ``tokenizer=`` name of it (not both)."""
    if processing_class is not None and tokenizer is not None and processing_class is not tokenizer:
        raise ValueError(
            "Trainer(processing_class=..., tokenizer=...) got two different objects: tokenizer is transformers 4's "
            "name of processing_class. Pass one of them."
        )
    return processing_class if processing_class is not None else tokenizer


def given_model(model: nn.Module | None, model_init: Any) -> nn.Module:
    """``model``, or ``model_init()`` when it is None; a TypeError for anything but a module."""
    if model is None and model_init is not None:
        model = _hyperparameter_search.call_model_init(model_init, None)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"Trainer(model=...) got {type(model).__name__}; pass a torch.nn.Module, or model_init=fn returning one."
        )
    return model
