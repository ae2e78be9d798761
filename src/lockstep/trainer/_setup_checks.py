"""Checks of the Trainer's inputs, and the model set-up they lead to."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from torch import nn

from lockstep.backends import ShardedCheckpointIO
from lockstep.memory.activation_policy import apply_activation_policy, parse_activation_policy
from lockstep.trainer import _hf_datasets
from lockstep.trainer.accelerator_factory import supports_gradient_checkpointing
from lockstep.trainer.arguments import TrainingArguments
from lockstep.utils import is_peft_model


def check_transformers_resume(accelerator: Any, folder: Path) -> None:
    """Refuse resuming a ``transformers.Trainer`` checkpoint into a backend that shards the training state
    over processes (FSDP, DeepSpeed, tensor or pipeline parallel): its files are read whole into each
    process's model and optimizer."""
    if accelerator.capability(ShardedCheckpointIO) is not None:
        raise NotImplementedError(
            f"resume_from_checkpoint={str(folder)!r} is a transformers.Trainer checkpoint; lockstep reads those "
            "into DDP or single-process runs only, not FSDP, DeepSpeed or a ParallelismConfig layout, which "
            "shard the training state. Resume it without fsdp/deepspeed/parallelism_config, or from a lockstep "
            "checkpoint."
        )


def check_inputs(
    args: TrainingArguments,
    *,
    train_dataset: Any,
    eval_dataset: Any,
    optimizers: tuple[Any, Any],
    compute_loss_func: Any,
    compute_metrics: Any,
) -> None:
    """Refuse Trainer inputs that cannot work together, saying what to change."""
    _hf_datasets.check_dataset(train_dataset, "Trainer(train_dataset=...)")
    _hf_datasets.check_dataset(eval_dataset, "Trainer(eval_dataset=...)")
    if args.eval_strategy != "no" and eval_dataset is None:
        raise ValueError(
            f"TrainingArguments(eval_strategy={args.eval_strategy!r}) needs an evaluation set: pass "
            "Trainer(eval_dataset=...) or set eval_strategy='no'."
        )
    if compute_loss_func is not None and args.label_smoothing_factor > 0:
        raise ValueError(
            f"TrainingArguments(label_smoothing_factor={args.label_smoothing_factor}) smooths the default "
            "cross-entropy loss, but Trainer(compute_loss_func=...) replaces that loss. Smooth inside "
            "compute_loss_func, or set label_smoothing_factor=0."
        )
    if not (isinstance(optimizers, (tuple, list)) and len(optimizers) == 2):
        raise TypeError(
            "Trainer(optimizers=...) must be a pair (optimizer, lr_scheduler); either may be None."
        )
    if optimizers[0] is None and optimizers[1] is not None:
        raise ValueError(
            "Trainer(optimizers=(None, scheduler)): a scheduler needs the optimizer it was built on; pass both."
        )
    _check_batch_metrics(args, compute_metrics)


def enable_gradient_checkpointing(model: nn.Module, args: TrainingArguments) -> None:
    """``gradient_checkpointing``: recompute activations in the backward pass (transformers models)."""
    if not args.gradient_checkpointing:
        return
    if args.activation_checkpointing_policy not in (None, "full"):
        _apply_policy_to_layers(model, args)
        return
    if not supports_gradient_checkpointing(model):
        raise ValueError(
            f"TrainingArguments(gradient_checkpointing=True), but {type(model).__name__} does not support it "
            "(it has no gradient_checkpointing_enable). Use a transformers model, or wrap layers with "
            "torch.utils.checkpoint yourself."
        )
    kwargs = args.gradient_checkpointing_kwargs or {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the transformers >= 5.x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # A peft model's adapters sit behind frozen embeddings: with reentrant checkpoints no gradient reaches
    # them unless the embeddings' output requires grad. transformers 5 sets this hook itself for text models
    # (then it is not set twice), transformers 4 only for adapters loaded through its own peft integration.
    hooked = getattr(model, "_require_grads_hooks", None) or getattr(model, "_require_grads_hook", None)
    if is_peft_model(model) and not hooked and callable(getattr(model, "enable_input_require_grads", None)):
        model.enable_input_require_grads()


def _apply_policy_to_layers(model: nn.Module, args: TrainingArguments) -> None:
    """A policy other than ``full``: lockstep wraps the model's layers (its ``_no_split_modules`` classes)."""
    # The layers transformers' own checkpointing wraps (GradientCheckpointingLayer, transformers >= 4.52), else
    # the _no_split_modules classes (which may also name the embeddings).
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [
        m for m in model.modules() if any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)
    ]
    layers = layers or [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"TrainingArguments(activation_checkpointing_policy={args.activation_checkpointing_policy!r}) applies "
            f"to the model's repeated layers, but {type(model).__name__} names none (_no_split_modules: "
            f"{sorted(names) or 'none'}) that it contains. Use activation_checkpointing_policy='full' or a "
            "transformers model."
        )
    if getattr(model, "is_activation_checkpointing", None) or (  # transformers 5's name, then 4's
        not hasattr(model, "is_activation_checkpointing")
        and getattr(model, "is_gradient_checkpointing", False)
    ):
        raise ValueError(
            f"{type(model).__name__} already has gradient checkpointing switched on; with "
            f"activation_checkpointing_policy={args.activation_checkpointing_policy!r} lockstep wraps its layers "
            "itself. Call model.gradient_checkpointing_disable() first."
        )
    apply_activation_policy(
        model, layers, parse_activation_policy(args.activation_checkpointing_policy, owner="policy")
    )


def _check_batch_metrics(args: TrainingArguments, compute_metrics: Any) -> None:
    if not args.batch_eval_metrics or compute_metrics is None:
        return
    if "compute_result" not in inspect.signature(compute_metrics).parameters:
        raise ValueError(
            "TrainingArguments(batch_eval_metrics=True) calls compute_metrics(prediction, compute_result=...) on "
            "every batch (compute_result is True on the last one, which must return the metrics), but "
            f"{getattr(compute_metrics, '__name__', compute_metrics)!r} takes no compute_result. Add that parameter, "
            "or set batch_eval_metrics=False."
        )


def checked_arguments(args: TrainingArguments | None, **inputs: Any) -> TrainingArguments:
    """``args`` (default ``TrainingArguments()``), checked against the Trainer's other inputs
    (:func:`check_inputs`)."""
    args = args if args is not None else TrainingArguments()
    if not isinstance(args, TrainingArguments):
        raise TypeError(f"Trainer(args=...) got {type(args).__name__}; pass a lockstep.TrainingArguments.")
    check_inputs(args, **inputs)
    return args
