"""The Accelerator's process control: barriers, printing, per-process decorators, uneven inputs.

A base class of :class:`lockstep.Accelerator`; each method delegates to the process state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from lockstep.state import AcceleratorState

F = TypeVar("F", bound=Callable[..., Any])


class ProcessControl:
    """Coordination between the processes of a job."""

    state: AcceleratorState
    use_distributed: bool

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

    def on_main_process(self, function: F) -> F:
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: F) -> F:
        return self.state.on_local_main_process(function)

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
        from torch.distributed.algorithms.join import Join

        with Join(list(joinables)):
            yield
