"""Inside Ray Train: lockstep joins the process group Ray created, or says why it cannot.

Ray Train's ``TorchTrainer`` starts one worker process per rank, publishes torchrun's variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ...) and ``ACCELERATE_TORCH_DEVICE`` in each, and calls
``init_process_group`` itself before the training function runs; lockstep reuses that group and device.
A Ray trainer that makes no torch group (a plain ``DataParallelTrainer``), or a group of another size than
Ray's worker group, would leave the workers training apart (each its own rank 0, all writing the same
checkpoints): refused here, before any training.

``ray`` is never imported here: a Ray Train worker has imported ``ray.train`` already, and a process that
has not is not one.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from lockstep import _env


def worker_group_size() -> int | None:
    """How many workers Ray Train started for this run, or None outside a Ray Train training function."""
    if not _env.started_by_ray():
        return None  # not a process Ray started (a torchrun worker that merely imports ray.train)
    train = sys.modules.get("ray.train")
    if train is None:
        return None
    try:
        return int(train.get_context().get_world_size())
    except RuntimeError:  # Ray Train v2 outside a training function: the driver or a plain task
        return None


def check_process_group() -> None:
    """Refuse to start when Ray Train's worker group and the torch process group disagree.

    Raises:
        RuntimeError: inside a Ray Train worker group of several workers with no torch process group, or
            with a group whose size differs from the worker group's.
    """
    workers = worker_group_size()
    if workers is None or workers <= 1:
        return
    if not dist.is_initialized():
        raise RuntimeError(
            f"lockstep is running in a Ray Train worker group of {workers} workers, but no torch process "
            "group exists in this worker: each worker would train alone as rank 0 and overwrite the "
            "others' checkpoints. Start the training function with ray.train.torch.TorchTrainer, which "
            "creates the group that lockstep joins (and do not destroy it before the Accelerator is made)."
        )
    group = dist.get_world_size()
    if group != workers:
        raise RuntimeError(
            f"lockstep is running in a Ray Train worker group of {workers} workers, but the torch process "
            f"group has {group} processes (rank {dist.get_rank()}): the workers would not train as one "
            "job. Let ray.train.torch.TorchTrainer create the process group instead of calling "
            "init_process_group in the training function."
        )
