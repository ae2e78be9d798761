"""Who this process is, and coordination with the other processes of the job.

A base of :class:`lockstep.Accelerator` that stands on its own: it needs only a process state
(``ProcessView(PartialState())`` works), and every member reads or delegates to that state. Accelerate
puts these members on the Accelerator, so lockstep does too.

Example:
    >>> from lockstep.state import PartialState
    >>> view = ProcessView(PartialState(cpu=True))
    >>> view.num_processes, view.is_main_process
    (1, True)
    >>> view.multi_device, view.is_fsdp2, view.should_save_model
    (False, False, True)
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from lockstep.state import PartialState

F = TypeVar("F", bound=Callable[..., Any])


class ProcessView:
    """Rank, world size and device of this process, barriers, per-process printing and decorators.

    Args:
        state: the process state (an ``AcceleratorState`` in an Accelerator).
    """

    def __init__(self, state: PartialState) -> None:
        self.state = state

    # -- who am I ---------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.state.is_last_process

    @property
    def use_distributed(self) -> bool:
        return self.state.use_distributed

    # -- how the processes share the work ---------------------------------------------------------
    @property
    def multi_device(self) -> bool:
        """``Accelerator.multi_device``: whether this is data parallel on devices (see there)."""
        return self.state.multi_device

    @property
    def is_fsdp2(self) -> bool:
        """Whether models are sharded with FSDP2 (``fully_shard``); lockstep's FSDP is always FSDP2."""
        return self.state.is_fsdp2

    @property
    def deepspeed_plugin(self) -> Any:
        """The active ``DeepSpeedPlugin``, or None when DeepSpeed is not used."""
        return self.state.deepspeed_plugin

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        """Whether torch's composable parallelism (FSDP2 on DTensors) is in use: ``is_fsdp2``, as in Accelerate."""
        return self.is_fsdp2

    @property
    def should_save_model(self) -> bool:
        """``Accelerator.should_save_model``: whether this process writes model files (see there)."""
        return self.state.is_local_main_process

    # -- process control --------------------------------------------------------------------------
    def wait_for_everyone(self) -> None:
        """A barrier across all processes."""
        self.state.wait_for_everyone()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        self.state.print(*args, **kwargs)

    def main_process_first(self) -> contextlib.AbstractContextManager:
        return self.state.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager:
        return self.state.local_main_process_first()

    def split_between_processes(
        self, inputs: Any, apply_padding: bool = False
    ) -> contextlib.AbstractContextManager:
        return self.state.split_between_processes(inputs, apply_padding=apply_padding)

    def on_main_process(self, function: F | None = None) -> F:
        return self.state.on_main_process(_decorated("on_main_process", function))

    def on_local_main_process(self, function: F | None = None) -> F:
        return self.state.on_local_main_process(_decorated("on_local_main_process", function))

    def on_last_process(self, function: F) -> F:
        return self.state.on_last_process(function)

    def on_process(self, function: F | None = None, process_index: int | None = None) -> Any:
        return self.state.on_process(function, process_index=process_index)

    def on_local_process(self, function: F | None = None, local_process_index: int | None = None) -> Any:
        return self.state.on_local_process(function, local_process_index=local_process_index)

    @contextlib.contextmanager
    def join_uneven_inputs(
        self, joinables: Sequence[Any], even_batches: bool | None = None
    ) -> Iterator[None]:
        """Let DDP models train on loaders of different lengths per process (``torch.distributed.algorithms.Join``)."""
        if even_batches is not None:
            raise ValueError(
                "join_uneven_inputs(even_batches=...) is not supported: prepare the loaders with "
                "DataLoaderConfiguration(even_batches=False) instead."
            )
        if not self.use_distributed:
            yield
            return
        from torch.distributed.algorithms.join import Join, Joinable

        others = [type(joinable).__name__ for joinable in joinables if not isinstance(joinable, Joinable)]
        if others:
            # torch's Join needs a join hook on each object: only DDP models and ZeroRedundancyOptimizer have
            # one. Accelerate warns, in the words kept here first, and runs the block without Join where
            # joining is not supported (it joins DDP on GPUs only; lockstep on CPUs too).
            warnings.warn(
                "Joining uneven inputs is only supported for multi-GPU training, as a result "
                f"`join_uneven_inputs` will have no effect: it got {', '.join(others)}, which is not a "
                "DistributedDataParallel model (nor another torch Joinable); lockstep joins DDP models, on "
                "GPUs and on CPUs. Prepare the model with DDP, or give every process the same number of "
                "batches (DataLoaderConfiguration(even_batches=True)).",
                UserWarning,
                stacklevel=3,
            )
            yield
            return
        with Join(list(joinables)):
            yield


def _decorated(decorator: str, function: F | None) -> F:
    """``function``, or Accelerate's error for a decorator called without one (``accelerator.on_main_process()``:
    Accelerate's default ``None`` is only for its own methods)."""
    if function is None:
        raise ValueError(
            f"Accelerator.{decorator}() was called without a function: it is a decorator. Write "
            f"`@accelerator.{decorator}` above the function. (The `{decorator}` decorator must be called with a "
            "function on an instantiated `Accelerator` object.)"
        )
    return function
