"""TensorBoard event files through ``torch.utils.tensorboard`` (needs ``pip install tensorboard``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lockstep.tracking.base import GeneralTracker, plain_value


class TensorBoardTracker(GeneralTracker):
    """Scalars (and text, and dicts of scalars) as TensorBoard events in ``logging_dir/run_name``."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(
                "log_with='tensorboard' needs the tensorboard package: pip install tensorboard"
            ) from None
        self.logging_dir = Path(logging_dir) / run_name
        self.writer = SummaryWriter(str(self.logging_dir), **kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        plain = {k: plain_value(v) for k, v in values.items()}
        hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in plain.items()}
        self.writer.add_hparams(hparams, metric_dict={}, run_name=".")
        self.writer.flush()

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            value = plain_value(value)
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, {k: plain_value(v) for k, v in value.items()}, global_step=step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()
