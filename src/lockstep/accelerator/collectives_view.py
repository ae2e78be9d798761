"""The Accelerator's collectives (Accelerate's names): gather, gather_for_metrics, reduce, padding and the
trigger flag, over the data-parallel replicas the backend defines.

Example:
    >>> from lockstep.backends.registry import select_backend
    >>> from lockstep.state import GradientState, PartialState
    >>> state = PartialState(cpu=True)
    >>> view = CollectivesView(state, GradientState(), select_backend(state))
    >>> view.set_trigger(); view.check_trigger(), view.check_trigger()
    (True, False)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lockstep import collectives

if TYPE_CHECKING:
    from lockstep.backends.base import Backend
    from lockstep.state import GradientState, PartialState


class CollectivesView:
    """Collectives between the processes of a run.

    Args:
        state: the process state (the device of the trigger flag).
        gradient_state: where the evaluation loader's even-batches filler is recorded.
        backend: the backend, whose data-parallel group metrics are gathered and reduced over.
    """

    flag_tensor: torch.Tensor | None = None
    """The flag :meth:`set_trigger` raises (Accelerate's attribute)."""

    def __init__(self, state: PartialState, gradient_state: GradientState, backend: Backend) -> None:
        self._state = state
        self._gradient_state = gradient_state
        self._backend = backend

    def gather(self, tensor: Any) -> Any:
        """``Accelerator.gather``: tensors of every process, concatenated along dim 0 (see there)."""
        return collectives.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """``Accelerator.gather_for_metrics``: ``gather`` less the repeated samples (see there)."""
        return collectives.gather_for_metrics(
            input_data, self._gradient_state, use_gather_object, group=self._backend.data_parallel_group()
        )

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """``Accelerator.reduce``: tensors reduced across processes (see there)."""
        return collectives.reduce(
            tensor, reduction=reduction, scale=scale, group=self._backend.data_parallel_group()
        )

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        """Pad tensors to the largest size in ``dim`` across processes."""
        return collectives.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def set_trigger(self) -> None:
        """Raise a flag on this process that :meth:`check_trigger` will see on every process."""
        self.flag_tensor = torch.tensor(1, device=self._state.device)

    def check_trigger(self) -> bool:
        """True on every process when any process called :meth:`set_trigger` (then resets the flag)."""
        if self.flag_tensor is None:
            self.flag_tensor = torch.tensor(0, device=self._state.device)
        flag = collectives.reduce(self.flag_tensor, reduction="sum")
        if int(flag.item()) >= 1:
            self.flag_tensor = torch.tensor(0, device=self._state.device)
            return True
        return False
