"""The prepared optimizer: steps only when gradients are synchronised and not overflowed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lockstep._nested import send_to_device
from lockstep.state import GradientState
from lockstep.step_hooks import StepHooks

_NO_HOOKS = StepHooks()


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer for the Accelerator.

    ``step()`` does nothing on the micro-steps of gradient accumulation (``sync_gradients`` False);
    under fp16 it goes through the GradScaler, and ``step_was_skipped`` tells whether the scaler
    skipped the step because gradients overflowed, or a step hook did not commit it. ``zero_grad()``
    likewise waits for a real step.

    Args:
        optimizer: the user's optimizer.
        device_placement: move loaded state to ``device``.
        scaler: the fp16 GradScaler, if any.
        device: the training device.
        step_hooks: the Accelerator's step hooks (:mod:`lockstep.step_hooks`): every real (synchronised)
            step runs inside their ``around_optimizer_step``, and is applied only when they ``commit`` it.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device_placement: bool = True,
        scaler: torch.amp.GradScaler | None = None,
        device: torch.device | None = None,
        *,
        step_hooks: StepHooks | None = None,
    ) -> None:
        # The wrapped optimizer owns param_groups and state; the base __init__ is deliberately not called.
        self.optimizer = optimizer
        self.scaler = scaler
        self.device_placement = device_placement
        self.device = device
        self.gradient_state = GradientState()
        self._is_overflow = False
        self._step_hooks = _NO_HOOKS if step_hooks is None else step_hooks

    # torch.optim.Optimizer reads these attributes directly.
    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, param_groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found normally: forward them to the wrapped optimizer.
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.device_placement and self.device is not None:
            state_dict = send_to_device(state_dict, self.device)
        self.optimizer.load_state_dict(state_dict)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def train(self) -> None:
        """Switch optimizers that have modes (e.g. schedule-free) to training mode."""
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    steps_taken = 0
    """Optimizer steps taken (calls at a synchronising step, skipped ones included), saved in checkpoints."""

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        if not self.gradient_state.sync_gradients:
            return None
        self.steps_taken += 1
        with self._step_hooks.around_optimizer_step(self):
            return self._synchronized_step(closure)

    def _synchronized_step(self, closure: Callable[[], float] | None) -> Any:
        hooks = self._step_hooks
        if hooks.decides_commits:
            if closure is not None:
                raise ValueError(
                    f"optimizer.step(closure) cannot run under step hooks that decide whether a step is applied "
                    f"({', '.join(type(hook).__name__ for hook in hooks)}; e.g. Accelerator(fault_tolerance=...), "
                    "one quorum per step): they decide on the gradients before the step, which a closure "
                    "computes again. Call loss.backward() yourself and optimizer.step() without a closure."
                )
            self._discarded = not hooks.commit(self)
            if self._discarded:
                self._is_overflow = False
                return None
        if self.scaler is None:
            self._is_overflow = False
            return self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        return self._scaled_step(closure)

    def _scaled_step(self, closure: Callable[[], float] | None) -> Any:
        """Step through the GradScaler and record whether it skipped the step (inf/nan gradients)."""
        assert self.scaler is not None
        called = False
        inner_step = self.optimizer.step
        had_instance_step = "step" in self.optimizer.__dict__

        def recording_step(*args: Any, **kwargs: Any) -> Any:
            nonlocal called
            called = True
            return inner_step(*args, **kwargs)

        self.optimizer.step = recording_step  # type: ignore[method-assign]
        try:
            result = (
                self.scaler.step(self.optimizer, closure) if closure else self.scaler.step(self.optimizer)
            )
            self.scaler.update()
        finally:
            if had_instance_step:
                self.optimizer.step = inner_step  # type: ignore[method-assign]
            else:
                del self.optimizer.step
        self._is_overflow = not called
        return result

    _discarded = False

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step()`` was skipped because of gradient overflow, or because a step hook
        did not commit it (a fault-tolerant step that not every replica group committed); schedulers then
        stay."""
        return self._is_overflow or self._discarded

    @property
    def is_overflow(self) -> bool:
        return self._is_overflow

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("gradient_state", None)
        state.pop("_step_hooks", None)  # the Accelerator's, of this process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.gradient_state = GradientState()
        self._step_hooks = _NO_HOOKS

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"
