"""Checkpoints a transformers user recognises, both ways.

Writing: every ``checkpoint-<step>`` also holds ``trainer_state.json`` in transformers' format (log
history, best metric and checkpoint, global step, epoch, callback states) and, for a model with a
transformers ``config``, ``config.json`` (and ``generation_config.json``) next to the ``model.safetensors``
lockstep writes anyway, so ``AutoModel.from_pretrained("checkpoint-<step>")`` reads the folder. These files
are written into the save's staging folder, so the manifest covers them.

Reading: :func:`load_transformers_checkpoint` resumes from a folder written by ``transformers.Trainer``:
weights (safetensors, or ``.bin`` read with ``weights_only=True``; a peft model's ``adapter_model.safetensors``
into its adapter), ``optimizer.pt``, ``scheduler.pt``,
``rng_state.pth``/``rng_state_<rank>.pth`` and ``trainer_state.json``, all loaded without unpickling
objects. What is not exact: ``training_args.bin`` (a pickle) is not read; the data order of the resumed
epoch is lockstep's draw, not the one transformers would have made (the batches already seen in that
epoch are skipped by count, as transformers does); the running training loss is rebuilt from the logged
losses; ``scaler.pt`` (fp16) and the CUDA RNG of another device count are not restored.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lockstep.checkpoint import load_model_files, safe_torch_load
from lockstep.trainer.callbacks import CallbackHandler, TrainerControl, TrainerState
from lockstep.utils import is_peft_model

logger = logging.getLogger("lockstep.trainer")

TRAINER_STATE_NAME = "trainer_state.json"
MANIFEST_NAME = "manifest.json"
_TRANSFORMERS_STATE_FIELDS = (
    "epoch global_step max_steps logging_steps eval_steps save_steps train_batch_size num_train_epochs "
    "num_input_tokens_seen log_history best_metric best_global_step best_model_checkpoint "
    "is_local_process_zero is_world_process_zero"
).split()


# -- writing ----------------------------------------------------------------------------------------
def export_callback_states(handler: CallbackHandler, control: TrainerControl) -> dict[str, Any]:
    """transformers' ``stateful_callbacks``: ``{class name: {"args": ..., "attributes": ...}}`` of the control
    and of every callback with a ``state()`` method (a list when a class appears more than once)."""
    exported: dict[str, Any] = {}
    for owner in [*handler.callbacks, control]:
        state_of = getattr(owner, "state", None)
        if not callable(state_of):
            continue
        name, state = type(owner).__name__, state_of()
        if name not in exported:
            exported[name] = state
        elif isinstance(exported[name], list):
            exported[name].append(state)
        else:
            exported[name] = [exported[name], state]
    return exported


def trainer_state_json(state: TrainerState) -> dict[str, Any]:
    """``state`` as transformers' ``TrainerState.save_to_json`` writes it."""
    record: dict[str, Any] = {name: getattr(state, name) for name in _TRANSFORMERS_STATE_FIELDS}
    record.update(
        total_flos=0.0,  # lockstep does not count floating-point operations
        is_hyper_param_search=state.trial_params is not None,
        trial_name=state.trial_name,
        trial_params=state.trial_params,
        stateful_callbacks=state.stateful_callbacks,
    )
    return record


def write_trainer_state(folder: Path, state: TrainerState) -> None:
    text = json.dumps(trainer_state_json(state), indent=2, sort_keys=True) + "\n"
    (folder / TRAINER_STATE_NAME).write_text(text, encoding="utf-8")


def write_model_config(folder: Path, model: nn.Module) -> bool:
    """``config.json`` (and ``generation_config.json``) of a transformers model; False for other modules."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "save_pretrained", None)):
        return False
    config.save_pretrained(str(folder))
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(str(folder))
    return True


# -- reading ----------------------------------------------------------------------------------------
def is_transformers_checkpoint(folder: Path) -> bool:
    """A folder ``transformers.Trainer`` wrote: a ``trainer_state.json`` and no lockstep manifest."""
    return (folder / TRAINER_STATE_NAME).is_file() and not (folder / MANIFEST_NAME).is_file()


def read_trainer_state(folder: Path) -> dict[str, Any]:
    return json.loads((folder / TRAINER_STATE_NAME).read_text(encoding="utf-8"))


def apply_trainer_state(state: TrainerState, saved: Mapping[str, Any]) -> None:
    """Take the fields of a transformers ``trainer_state.json`` that lockstep's TrainerState has."""
    for name in (*_TRANSFORMERS_STATE_FIELDS, "trial_name", "trial_params", "stateful_callbacks"):
        if name in saved and name not in ("is_local_process_zero", "is_world_process_zero"):
            setattr(state, name, saved[name])
    state.stateful_callbacks = dict(state.stateful_callbacks or {})
    # The running loss: rebuilt from the logged losses (transformers keeps no sum in its state).
    total, previous = 0.0, 0
    for entry in state.log_history:
        if "loss" in entry and "step" in entry:
            total += float(entry["loss"]) * (int(entry["step"]) - previous)
            previous = int(entry["step"])
    state.total_loss, state.loss_since_log, state.steps_since_log = total, 0.0, 0


ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""Where peft (and transformers.Trainer with a peft model) writes an adapter's weights."""


def load_weights(model: nn.Module, folder: Path) -> None:
    """Load the checkpoint's weights into the (unwrapped) model; tied weights may be absent from the files. A
    peft model takes the adapter of a folder peft wrote (``adapter_model.safetensors``), its base untouched."""
    if is_peft_model(model) and (folder / ADAPTER_WEIGHTS).is_file():
        _load_adapter(model, folder)
        return
    loaded = load_model_files(folder)
    expected = model.state_dict()
    missing = [key for key in expected if key not in loaded]
    unexpected = [key for key in loaded if key not in expected]
    stored = {expected[key].data_ptr() for key in expected if key in loaded}
    untied = [key for key in missing if expected[key].data_ptr() not in stored]
    if untied or unexpected:
        raise ValueError(
            f"resume_from_checkpoint={str(folder)!r}: its weights do not match {type(model).__name__}. Missing "
            f"({len(untied)}): {untied[:10]}. Unknown to the model ({len(unexpected)}): {unexpected[:10]}. "
            "Resume with the model architecture the checkpoint was trained with."
        )
    model.load_state_dict(loaded, strict=False)


def _load_adapter(model: nn.Module, folder: Path) -> None:
    """peft's ``adapter_model.safetensors`` into the active adapter of ``model`` (names without the adapter's)."""
    from safetensors.torch import load_file

    from lockstep.integrations.peft import load_adapter_state_dict

    result = load_adapter_state_dict(model, load_file(str(folder / ADAPTER_WEIGHTS)))
    unexpected = list(getattr(result, "unexpected_keys", []))
    if unexpected:
        raise ValueError(
            f"resume_from_checkpoint={str(folder)!r}: {ADAPTER_WEIGHTS} holds {len(unexpected)} tensors this peft "
            f"model has no place for (e.g. {unexpected[:3]}). Resume with the LoraConfig (target modules, rank) "
            "the checkpoint was trained with."
        )


def restore_rng(folder: Path, *, rank: int, world_size: int) -> bool:
    """Restore Python, NumPy and torch CPU generators from ``rng_state[_<rank>].pth``; False when absent."""
    path = folder / (f"rng_state_{rank}.pth" if world_size > 1 else "rng_state.pth")
    if not path.is_file():
        logger.info("%s has no %s: the random generators are not restored.", folder, path.name)
        return False
    saved = safe_torch_load(path, numpy=True)
    random.setstate(_as_tuples(saved["python"]))
    np.random.set_state(saved["numpy"])
    torch.random.set_rng_state(saved["cpu"])
    return True


def _as_tuples(value: Any) -> Any:
    """Python's random state wants tuples all the way down."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuples(v) for v in value)
    return value


def load_optimizer_and_scheduler(folder: Path, optimizer: Any, scheduler: Any) -> None:
    states = []
    for name in ("optimizer.pt", "scheduler.pt"):
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(
                f"resume_from_checkpoint={str(folder)!r} has no {name}: a transformers checkpoint saved with "
                "save_only_model=True cannot resume training. Load its weights with from_pretrained and train "
                "without resume_from_checkpoint."
            )
        states.append(safe_torch_load(path))
    optimizer_state, scheduler_state = _without_empty_groups(*states, groups=len(optimizer.param_groups))
    optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(scheduler_state)


def _without_empty_groups(optimizer: dict, scheduler: dict, *, groups: int) -> tuple[dict, dict]:
    """transformers keeps an empty parameter group (no parameter without weight decay: a LoRA adapter's), which
    lockstep's optimizer does not have: drop it from the optimizer's state and the scheduler's per-group lists
    when that makes the groups match (parameter ids are numbered over the groups, so none changes)."""
    saved = optimizer["param_groups"]
    keep = [i for i, group in enumerate(saved) if group["params"]]
    if len(saved) == groups or len(keep) != groups:
        return optimizer, scheduler
    per_group = {
        key: [value[i] for i in keep]
        for key, value in scheduler.items()
        if isinstance(value, list) and len(value) == len(saved)
    }
    return {**optimizer, "param_groups": [saved[i] for i in keep]}, {**scheduler, **per_group}


def data_position(global_step: int, updates_per_epoch: int | None, accumulation: int) -> dict[str, int]:
    """The loader position after ``global_step`` optimizer steps, counted as transformers counts it."""
    if not updates_per_epoch:
        return {"epoch": 0, "batches_yielded": global_step * accumulation}
    epoch, steps_in_epoch = divmod(global_step, updates_per_epoch)
    return {"epoch": epoch, "batches_yielded": steps_in_epoch * accumulation}


def restore_callbacks(
    handler: CallbackHandler, control: TrainerControl, saved: Mapping[str, Any]
) -> TrainerControl:
    """transformers' ``restore_callback_states_from_checkpoint``: rebuild each saved callback (and the
    control) from its ``args`` and ``attributes``; returns the control to use."""
    owners = [*handler.callbacks, control]
    not_found = []
    for name, data in saved.items():
        states = data if isinstance(data, list) else [data]
        same = [owner for owner in owners if type(owner).__name__ == name]
        if not same:
            not_found.append(name)
            continue
        for owner, state in zip(same, states, strict=False):
            rebuilt = type(owner)(**state.get("args", {}))
            for attribute, value in state.get("attributes", {}).items():
                setattr(rebuilt, attribute, value)
            if isinstance(owner, TrainerControl):
                # A checkpoint saved as training stopped holds should_training_stop=True; resuming means going on.
                rebuilt.should_training_stop = rebuilt.should_epoch_stop = False
                control = rebuilt
            else:
                handler.callbacks[handler.callbacks.index(owner)] = rebuilt
    if not_found:
        logger.warning(
            "The checkpoint holds states of callbacks this Trainer does not have; ignoring them: %s",
            ", ".join(not_found),
        )
    return control


def resume_from_transformers(
    folder: Path,
    *,
    model: nn.Module,
    optimizer: Any,
    scheduler: Any,
    loader: Any,
    state: TrainerState,
    rank: int,
    world_size: int,
    updates_per_epoch: int | None,
    accumulation: int,
) -> None:
    """Continue from a ``transformers.Trainer`` checkpoint (see the module docstring for what is not exact).

    Args:
        folder: the checkpoint folder.
        model: the unwrapped model (its weights are replaced).
        optimizer, scheduler: the prepared optimizer and scheduler.
        loader: the prepared training loader (positioned after the steps already trained).
        state: the run's TrainerState.
        rank, world_size: this process and the number of processes (which RNG file to read).
        updates_per_epoch, accumulation: to count the batches already seen, as transformers does.
    """
    saved = read_trainer_state(folder)
    load_weights(model, folder)
    load_optimizer_and_scheduler(folder, optimizer, scheduler)
    restore_rng(folder, rank=rank, world_size=world_size)
    apply_trainer_state(state, saved)
    loader.load_state_dict(data_position(state.global_step, updates_per_epoch, accumulation))
    if (folder / "training_args.bin").is_file():
        logger.info(
            "%s/training_args.bin is a pickle and is not read; the arguments of this run apply.", folder
        )
