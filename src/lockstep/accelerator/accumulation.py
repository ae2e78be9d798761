"""Where a loop stands in a gradient accumulation cycle, and when gradients synchronise."""

from __future__ import annotations

from lockstep.state import GradientState


class GradientAccumulation:
    """The micro-step counter of ``accumulate()`` and the decision to synchronise.

    Gradients synchronise every ``num_steps`` micro-batches, and at the end of a prepared dataloader
    (``GradientAccumulationPlugin(sync_with_dataloader=True)``, the default), so that an epoch never
    leaves gradients behind.

    Args:
        gradient_state: the process's shared gradient state (read by prepared optimizers and schedulers).
    """

    def __init__(self, gradient_state: GradientState) -> None:
        self.gradient_state = gradient_state
        self.step = 0
        """Micro-batches since the last synchronisation (saved in checkpoints, so a resume continues the
        cycle where it stopped)."""

    @property
    def num_steps(self) -> int:
        return self.gradient_state.num_steps

    def advance(self) -> None:
        """Count one micro-batch and decide whether its backward synchronises gradients."""
        state = self.gradient_state
        if state.sync_with_dataloader and state.end_of_dataloader:
            self.step = 0
            state._set_sync_gradients(True)
        else:
            self.step += 1
            state._set_sync_gradients(self.step % self.num_steps == 0)
