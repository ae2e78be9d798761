"""The same training loop written four ways, each as its tool's documentation shows it.

- hand-written PyTorch: ``DistributedDataParallel`` (or ``fully_shard`` on each block and the root) and a
  ``DistributedSampler``, ``loss.backward()``;
- lockstep and Accelerate: the four-line change, ``Accelerator()`` + ``prepare`` + ``accelerator.backward``
  (Accelerate needs ``cpu=True`` to run more than one process on a CPU-only machine; its FSDP plugin on CPU
  silently stays DDP, which the memory figures show);
- Lightning Fabric: ``Fabric(...).launch()``, ``setup`` / ``setup_dataloaders``, ``fabric.backward``; FSDP2
  through ``ModelParallelStrategy(parallelize_fn=...)`` with ``fully_shard``, as its docs show.

Each tool gets one object per process (an ``Accelerator``, a ``Fabric``), made on first use.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset, DistributedSampler

WRAP_CLASS = "Layer"  # the FSDP unit of bench/_fsdp_worker.py's model


@dataclass
class Loop:
    """What one tool's training loop holds: the prepared model, optimizer and loader, and its backward."""

    tool: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loader: DataLoader
    backward: Callable[[torch.Tensor], None]
    steps: list[int] = field(default_factory=lambda: [0])  # optimizer steps taken (a step hook counts)


def _count_steps(optimizer: torch.optim.Optimizer, counter: list[int]) -> None:
    def hook(*_: object) -> None:
        counter[0] += 1

    optimizer.register_step_post_hook(hook)


def _blocks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == WRAP_CLASS]


@functools.cache
def lockstep_accelerator(fsdp: bool):
    from lockstep import Accelerator, FullyShardedDataParallelPlugin

    if not fsdp:
        return Accelerator()
    plugin = FullyShardedDataParallelPlugin(
        auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_cls_names_to_wrap=[WRAP_CLASS]
    )
    return Accelerator(fsdp_plugin=plugin)


@functools.cache
def accelerate_accelerator(fsdp: bool):
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    if not fsdp:
        return Accelerator(cpu=True)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=[WRAP_CLASS]
    )
    return Accelerator(cpu=True, fsdp_plugin=plugin)


def _shard_blocks(model: nn.Module, device_mesh) -> nn.Module:
    mesh = device_mesh["data_parallel"]
    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@functools.cache
def fabric(fsdp: bool, devices: int):
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import ModelParallelStrategy

    if fsdp:
        strategy = ModelParallelStrategy(
            parallelize_fn=_shard_blocks, data_parallel_size=devices, tensor_parallel_size=1
        )
    else:
        strategy = "ddp" if devices > 1 else "auto"
    instance = Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    instance.launch()
    return instance


def build(
    tool: str,
    model: nn.Module,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    dataset: Dataset,
    *,
    batch_size: int,
    shuffle: bool,
    fsdp: bool = False,
) -> Loop:
    """``tool``'s loop over ``model`` (fresh, unwrapped), an optimizer ``make_optimizer`` builds, and
    ``dataset`` in batches of ``batch_size`` per process."""
    builder = {"torch": _hand_written, "lockstep": _lockstep, "accelerate": _accelerate, "fabric": _fabric}
    return builder[tool](model, make_optimizer, dataset, batch_size=batch_size, shuffle=shuffle, fsdp=fsdp)


def _hand_written(model, make_optimizer, dataset, *, batch_size, shuffle, fsdp) -> Loop:
    if fsdp:
        for block in _blocks(model):
            fully_shard(block)
        fully_shard(model)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = make_optimizer(model)
    loop = Loop("torch", model, optimizer, None, lambda loss: loss.backward())
    _count_steps(optimizer, loop.steps)
    sampler = DistributedSampler(dataset, shuffle=shuffle, seed=0)
    loop.loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    return loop


def _lockstep(model, make_optimizer, dataset, *, batch_size, shuffle, fsdp) -> Loop:
    return _four_line_change(
        "lockstep", lockstep_accelerator(fsdp), model, make_optimizer, dataset, batch_size, shuffle
    )


def _accelerate(model, make_optimizer, dataset, *, batch_size, shuffle, fsdp) -> Loop:
    accelerator = accelerate_accelerator(fsdp)
    return _four_line_change("accelerate", accelerator, model, make_optimizer, dataset, batch_size, shuffle)


def _four_line_change(tool, accelerator, model, make_optimizer, dataset, batch_size, shuffle) -> Loop:
    """The same code for lockstep and Accelerate: only the Accelerator differs (the drop-in promise)."""
    optimizer = make_optimizer(model)
    steps = [0]
    _count_steps(optimizer, steps)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=shuffle)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return Loop(tool, model, optimizer, loader, accelerator.backward, steps)


def _fabric(model, make_optimizer, dataset, *, batch_size, shuffle, fsdp) -> Loop:
    instance = fabric(fsdp, dist.get_world_size() if dist.is_initialized() else 1)
    if fsdp:  # the optimizer is made after sharding, over the sharded parameters (Fabric's FSDP2 docs)
        model = instance.setup_module(model)
        optimizer = instance.setup_optimizers(make_optimizer(model))
    else:
        model, optimizer = instance.setup(model, make_optimizer(model))
    steps = [0]
    _count_steps(optimizer.optimizer, steps)
    loader = instance.setup_dataloaders(DataLoader(dataset, batch_size=batch_size, shuffle=shuffle))
    return Loop("fabric", model, optimizer, loader, instance.backward, steps)
