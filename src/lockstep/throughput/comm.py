"""Exposed communication: how long backward waits for DDP's gradient all-reduce after the last gradient.

DDP all-reduces gradients in buckets while backward still computes, and at the end of backward waits
for the buckets still in flight. That wait is the communication a step pays for, the rest being hidden
behind computation. It is measured as the time from the moment the *last* parameter gradient is
accumulated (the last bucket can then be launched) to the end of ``accelerator.backward``.

Which parameter is ready last is learned on the first synchronising backward (every parameter gets a
hook once); afterwards a hook sits on that one parameter only. If it stops being last (a dynamic graph),
the next backward learns again.

Not measured: DDP's buffer broadcast in forward, collectives the training loop calls itself (logging,
``gather``), the dataloader's random-state broadcast at each epoch start, and anything under
``no_sync`` (nothing is communicated there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lockstep.backends.ddp.backend import syncs_gradients_in_backward


class ExposedCommunication:
    """Marks the last gradient of each synchronising DDP backward.

    Args:
        clock: the step clock whose ``mark()`` records an instant.
    """

    def __init__(self, clock: Any) -> None:
        self.clock = clock
        self._last_param: dict[int, Any] = {}  # id(model) -> hook handle on its last-ready parameter
        self._learning: list[tuple[int, nn.Parameter, Any]] = []
        self._fired: Any = None
        self._fired_param: nn.Parameter | None = None

    def before_backward(self, models: Sequence[nn.Module]) -> bool:
        """Prepare for a backward; returns whether any DDP model synchronises gradients in it."""
        syncing = [m for m in models if syncs_gradients_in_backward(m)]
        self._fired, self._fired_param = None, None
        for model in syncing:
            if id(model) not in self._last_param:
                self._learn(model)
        return bool(syncing)

    def _learn(self, model: nn.Module) -> None:
        for param in model.parameters():
            if param.requires_grad:
                handle = param.register_post_accumulate_grad_hook(self._gradient_ready)
                self._learning.append((id(model), param, handle))

    def _gradient_ready(self, param: torch.Tensor) -> None:
        self._fired = self.clock.mark()
        self._fired_param = param  # type: ignore[assignment]

    def after_backward(self, syncing: bool) -> Any:
        """The mark of the last gradient of this backward (None when nothing was measured)."""
        if self._learning:
            self._finish_learning()
        if not syncing or self._fired is None:
            if syncing:  # the watched parameters got no gradient: learn again next time
                for handle in self._last_param.values():
                    handle.remove()
                self._last_param.clear()
            return None
        return self._fired

    def _finish_learning(self) -> None:
        last = self._fired_param
        for model_id, param, handle in self._learning:
            handle.remove()
            if param is last:
                self._last_param[model_id] = param.register_post_accumulate_grad_hook(self._gradient_ready)
        self._learning.clear()
        self._fired_param = None
