"""Count a model's FLOPs once, on the first optimizer step, with ``torch.utils.flop_counter``.

Every forward pass of a prepared model during the counted step runs under a ``FlopCounterMode``
(entered by a forward pre-hook, left by a forward hook that runs even when the forward raises), and so
does every ``accelerator.backward`` of that step. Operations outside those windows (a loss computed
outside the model, the optimizer) are not counted: torch's counter has formulas only for matrix
products, convolutions and attention, which is where nearly all of a model's FLOPs are anyway. After
the step the hooks are removed, so later steps run untouched.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn


class FlopCounting:
    """The model FLOPs of the first optimizer step (all its micro-batches, forward and backward).

    Args:
        models: returns the prepared models (looked up when counting is armed).
    """

    def __init__(self, models: Callable[[], Sequence[nn.Module]]) -> None:
        self._models = models
        self._handles: list[Any] = []
        self._window: contextlib.ExitStack | None = None
        self._window_owner: nn.Module | None = None
        self._mode: Any = None
        self._step_flops = 0
        self.counting_this_step = False
        """True once a forward pass of the current step has been counted."""
        self.flops: int | None = None
        """FLOPs of the counted step (None until it ends)."""
        self.elements = 0
        """Padded input elements of the counted step, to scale ``flops`` to steps of another size."""

    @property
    def done(self) -> bool:
        return self.flops is not None

    def arm(self) -> None:
        """Hook the prepared models so that their next forward passes are counted."""
        if self.done or self._handles:
            return
        for model in self._models():
            self._handles.append(model.register_forward_pre_hook(self._forward_started))
            self._handles.append(model.register_forward_hook(self._forward_finished, always_call=True))

    def _forward_started(self, module: nn.Module, args: Any) -> None:
        if self._window is None:  # a prepared model called inside another one is counted by the outer
            self._window, self._window_owner = self._open_window(), module

    def _forward_finished(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._window is not None and self._window_owner is module:
            self._close_window()
            self.counting_this_step = True

    def open_backward(self) -> None:
        """Start counting a backward pass, when this step's forward passes are being counted."""
        if self.counting_this_step and self._window is None:
            self._window = self._open_window()

    def close_backward(self) -> None:
        if self._window is not None and self._window_owner is None:
            self._close_window()

    def _open_window(self) -> contextlib.ExitStack:
        from torch.utils.flop_counter import FlopCounterMode

        stack = contextlib.ExitStack()
        # The counter tracks modules with global hooks, about which torch.compile'd modules warn; the
        # warning is about our counting, not the user's code.
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=r".*global hooks on modules", category=UserWarning)
        self._mode = stack.enter_context(FlopCounterMode(display=False))
        return stack

    def _close_window(self) -> None:
        assert self._window is not None
        self._window.close()
        self._step_flops += int(self._mode.get_total_flops())
        self._window, self._window_owner, self._mode = None, None, None

    def end_step(self, elements: int) -> bool:
        """Close the step; returns True when it was the counted one (then ``flops`` is set)."""
        if not self.counting_this_step:
            return False
        if self._window is not None:  # a forward that never returned: count what ran
            self._close_window()
        self.flops, self.elements = self._step_flops, elements
        self.counting_this_step = False
        self.disarm()
        return True

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
