"""TensorBoard event files through ``torch.utils.tensorboard`` (needs ``pip install tensorboard``)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from lockstep.tracking.base import GeneralTracker, not_started, plain_value

_INSTALL = "pip install tensorboard"


class TensorBoardTracker(GeneralTracker):
    """Scalars (and text, and dicts of scalars) as TensorBoard events in ``logging_dir/run_name``.

    Args:
        run_name: the run's folder under ``logging_dir`` (the project name given to ``init_trackers``).
        logging_dir: the project's logging folder.
        **kwargs: passed to ``SummaryWriter`` (``flush_secs``, ``max_queue``...).

    The ``SummaryWriter`` (and its folder) is made by ``start()``, which ``init_trackers`` calls.
    """

    name = "tensorboard"
    requires_logging_directory = True
    requires_packages = ("tensorboard",)
    install_command = _INSTALL

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        self.run_name = run_name
        self.logging_dir = Path(logging_dir) / run_name
        self.init_kwargs = kwargs
        self.writer: Any = None

    def start(self) -> None:
        """Open the ``SummaryWriter``."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(f"log_with='tensorboard' needs the tensorboard package: {_INSTALL}") from None
        self.writer = SummaryWriter(str(self.logging_dir), **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    def _started_writer(self) -> Any:
        if self.writer is None:
            raise not_started(self)
        return self.writer

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record the run's hyperparameters as Accelerate does: ``add_hparams`` (numbers, strings and bools;
        None values are left out, as torch's writer does; other values as their text) and the whole
        configuration as ``hparams.yml`` in a folder named by the time, under the run's folder."""
        writer = self._started_writer()
        plain = {k: plain_value(v) for k, v in values.items()}
        hparams = {
            k: v if v is None or isinstance(v, (int, float, str, bool)) else str(v) for k, v in plain.items()
        }
        writer.add_hparams(hparams, metric_dict={})
        writer.flush()
        folder = self.logging_dir / str(time.time())
        folder.mkdir(parents=True, exist_ok=True)
        _write_yaml(folder / "hparams.yml", plain)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        writer = self._started_writer()
        for key, value in values.items():
            value = plain_value(value)
            if isinstance(value, (int, float)):
                writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                writer.add_scalars(key, {k: plain_value(v) for k, v in value.items()}, global_step=step)
        writer.flush()

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _write_yaml(path: Path, values: dict[str, Any]) -> None:
    import yaml

    try:
        text = yaml.safe_dump(values)
    except yaml.representer.RepresenterError as error:
        raise ValueError(
            f"The tracker configuration cannot be written as YAML ({error}): pass numbers, strings, bools, "
            "None, or lists and dicts of them to init_trackers(config=...)."
        ) from None
    path.write_text(text, encoding="utf-8")
