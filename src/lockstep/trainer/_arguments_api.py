"""transformers' ``TrainingArguments`` methods and properties beyond the fields, for lockstep's arguments.

Written as functions of the arguments (``self``); ``TrainingArguments`` defines each as a method or property
whose one-line body calls the function here. The process facts (``device``, ``world_size``...) come
from lockstep's :class:`~lockstep.state.PartialState`, created on first use with the arguments' ``use_cpu``,
``ddp_backend`` and ``ddp_timeout`` (the Trainer's Accelerator later shares it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import math
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from lockstep.state import PartialState

# typed loosely: arguments.py calls these functions, so importing it here would be an import cycle
TrainingArguments = Any
logger = logging.getLogger("lockstep.trainer")


class ParallelMode(str, enum.Enum):
    """How this run spreads over devices (transformers' ``ParallelMode`` values).

    lockstep never runs ``torch.nn.DataParallel``, so ``NOT_DISTRIBUTED`` does not occur.
    """

    NOT_PARALLEL = "not_parallel"
    NOT_DISTRIBUTED = "not_distributed"
    DISTRIBUTED = "distributed"


# -- the process ------------------------------------------------------------------------------------
def distributed_state(self: TrainingArguments) -> PartialState:
    """The process state (created on first use from ``use_cpu``, ``ddp_backend`` and ``ddp_timeout``; with
    ``accelerator_config`` ``use_configured_state``, the one the script created before, which must exist).

    Raises:
        ValueError: ``use_configured_state`` is true and no ``Accelerator`` or ``PartialState`` exists yet.
    """
    from lockstep.state import PartialState

    check_configured_state(self)
    return PartialState(cpu=self.use_cpu, backend=self.ddp_backend, timeout=ddp_timeout_delta(self))


def check_configured_state(self: TrainingArguments) -> None:
    """With ``accelerator_config`` ``use_configured_state``, refuse to go on before the script created its
    ``Accelerator`` or ``PartialState`` (transformers' check, made where the devices are first needed: the
    arguments' process facts, or the Trainer's Accelerator)."""
    from lockstep.state import PartialState

    if PartialState._context is None and getattr(self.accelerator_config, "use_configured_state", False):
        raise ValueError(
            "TrainingArguments(accelerator_config={'use_configured_state': True}) uses the Accelerator or "
            "PartialState the script created before the arguments set up the devices, and there is none yet. "
            "Create one first (PartialState() or Accelerator(...)), or leave use_configured_state false."
        )


def ddp_timeout_delta(self: TrainingArguments) -> timedelta:
    """``ddp_timeout`` as the ``timedelta`` ``init_process_group`` takes."""
    return timedelta(seconds=self.ddp_timeout)


def device(self: TrainingArguments) -> torch.device:
    """The device of this process (the CPU with ``use_cpu=True``)."""
    return distributed_state(self).device


def n_gpu(self: TrainingArguments) -> int:
    """``TrainingArguments.n_gpu``: the GPUs this process uses, 1 or 0 (see there)."""
    return 0 if device(self).type == "cpu" else 1


def parallel_mode(self: TrainingArguments) -> ParallelMode:
    """``ParallelMode.DISTRIBUTED`` with more than one process, else ``ParallelMode.NOT_PARALLEL``."""
    return ParallelMode.DISTRIBUTED if distributed_state(self).use_distributed else ParallelMode.NOT_PARALLEL


def world_size(self: TrainingArguments) -> int:
    """The number of processes of the job."""
    return distributed_state(self).num_processes


def process_index(self: TrainingArguments) -> int:
    """This process's rank in the job."""
    return distributed_state(self).process_index


def local_process_index(self: TrainingArguments) -> int:
    """This process's rank on its machine."""
    return distributed_state(self).local_process_index


def should_log(self: TrainingArguments) -> bool:
    """Whether this process logs: the first of each node (``log_on_each_node``), else the first of the job."""
    return (local_process_index(self) if self.log_on_each_node else process_index(self)) == 0


def should_save(self: TrainingArguments) -> bool:
    """Whether this process writes to disk: the first of each node (``save_on_each_node``), else of the job."""
    return (local_process_index(self) if self.save_on_each_node else process_index(self)) == 0


def get_process_log_level(self: TrainingArguments) -> int:
    """``TrainingArguments.get_process_log_level``: the log level of this process (see there)."""
    name = self.log_level if should_log(self) else self.log_level_replica
    if name == "passive":
        return logging.getLogger("lockstep").getEffectiveLevel()
    return logging.getLevelNamesMapping()[name.upper()]


@contextlib.contextmanager
def main_process_first(self: TrainingArguments, local: bool = True, desc: str = "work") -> Iterator[None]:
    """``TrainingArguments.main_process_first``: run the block on the first process first (see there)."""
    state = distributed_state(self)
    if state.num_processes == 1:
        yield
        return
    first = state.is_local_main_process if local else state.is_main_process
    where = "main local process" if local else "main process"
    logger.debug("%s: %s", where, desc) if first else logger.debug("waiting for the %s to do %s", where, desc)
    with state.local_main_process_first() if local else state.main_process_first():
        yield


# -- derived values ---------------------------------------------------------------------------------
def train_batch_size(self: TrainingArguments) -> int:
    """The batch size of one process's step (``per_device_train_batch_size``: one device per process)."""
    return self.per_device_train_batch_size


def eval_batch_size(self: TrainingArguments) -> int:
    """The evaluation batch size of one process (``per_device_eval_batch_size``)."""
    return self.per_device_eval_batch_size


def get_warmup_steps(self: TrainingArguments, num_training_steps: int) -> int:
    """``TrainingArguments.get_warmup_steps``: the warm-up steps of a run (see there)."""
    if self.warmup_steps >= 1:
        return int(self.warmup_steps)
    fraction = self.warmup_steps if self.warmup_steps > 0 else self.warmup_ratio
    return math.ceil(num_training_steps * fraction)


# -- serialization ----------------------------------------------------------------------------------
def to_dict(self: TrainingArguments) -> dict[str, Any]:
    """The fields as plain values (tokens hidden, config objects as dicts), as transformers writes them."""
    values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
    for name, value in values.items():
        if isinstance(value, enum.Enum):
            values[name] = value.value
        elif name.endswith("_token") and value is not None:
            values[name] = f"<{name.upper()}>"
        elif callable(getattr(value, "to_dict", None)):
            values[name] = value.to_dict()
        elif callable(getattr(value, "to_json", None)):
            values[name] = value.to_json()
    return values


def to_json_string(self: TrainingArguments) -> str:
    """:meth:`to_dict` as indented JSON."""
    return json.dumps(to_dict(self), indent=2, default=str)


def to_sanitized_dict(self: TrainingArguments) -> dict[str, Any]:
    """:meth:`to_dict` plus the batch sizes, every value a bool, int, float or str (TensorBoard's hparams)."""
    values = {
        **to_dict(self),
        "train_batch_size": train_batch_size(self),
        "eval_batch_size": eval_batch_size(self),
    }
    return {name: v if type(v) in (bool, int, float, str) else str(v) for name, v in values.items()}
