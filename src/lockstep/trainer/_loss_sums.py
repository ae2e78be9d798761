"""The running sums of the training loss, kept on the device so that no step waits for a sync."""

from __future__ import annotations

import torch

from lockstep.accelerator import Accelerator
from lockstep.trainer.callbacks import TrainerState


class LossSums:
    """Sums of the step losses since the last log and over the whole run.

    Args:
        device: where the sums live (the loss's device).
        nan_inf_filter: count a nan/inf step loss as the mean since the last log
            (``logging_nan_inf_filter``).
    """

    def __init__(self, device: torch.device, *, nan_inf_filter: bool) -> None:
        self.since_log = torch.zeros((), device=device)
        self.total = torch.zeros((), device=device)
        self.nan_inf_filter = nan_inf_filter

    def add(self, step_loss: torch.Tensor, steps_since_log: int) -> None:
        """Add one optimizer step's loss (``steps_since_log``: steps already in ``since_log``)."""
        if self.nan_inf_filter:
            mean_so_far = self.since_log / max(steps_since_log, 1)
            step_loss = torch.where(torch.isfinite(step_loss), step_loss, mean_so_far)
        self.since_log += step_loss
        self.total += step_loss

    def take_log_mean(self, accelerator: Accelerator, steps: int) -> float:
        """The mean step loss since the last log over all processes; starts a new logging period."""
        loss = accelerator.reduce(self.since_log, reduction="mean") / steps
        self.since_log.zero_()
        return float(loss)

    def train_loss(self, accelerator: Accelerator, global_step: int) -> float:
        """The mean step loss of the run over all processes."""
        return float(accelerator.reduce(self.total, reduction="mean")) / max(global_step, 1)

    def store(self, accelerator: Accelerator, state: TrainerState) -> None:
        """Average the sums over processes and keep them in ``state`` (checkpoints hold it)."""
        self.since_log = accelerator.reduce(self.since_log, reduction="mean")
        self.total = accelerator.reduce(self.total, reduction="mean")
        state.loss_since_log = float(self.since_log)
        state.total_loss = float(self.total)

    def restore(self, state: TrainerState) -> None:
        """Continue from the sums a checkpoint's ``state`` holds."""
        self.since_log.fill_(state.loss_since_log)
        self.total.fill_(state.total_loss)

    def reset(self) -> None:
        self.since_log.zero_()
        self.total.zero_()
