"""Weights & Biases runs (needs ``pip install wandb``); offline mode works without network.

Pass ``init_kwargs={"wandb": {"mode": "offline"}}`` (or set ``WANDB_MODE=offline``, which wandb reads itself)
to write the run to disk only; ``wandb sync`` uploads it later. The run folder goes under the project's
logging folder (``logging_dir/run_name/wandb/``) unless ``dir`` is given. wandb's banner lines are off
unless you pass your own ``settings``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lockstep.tracking.base import GeneralTracker, not_started

_INSTALL = "pip install wandb"


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise ImportError(f"log_with='wandb' needs the wandb package: {_INSTALL}") from None
    return wandb


class WandBTracker(GeneralTracker):
    """One wandb run: the config as the run's config, each ``log`` as one history row at ``step``.

    Args:
        run_name: the wandb project (the project name given to ``init_trackers``).
        logging_dir: the project's logging folder; wandb's files go to ``logging_dir/run_name/wandb``.
        **kwargs: passed to ``wandb.init`` (``mode="offline"``, ``entity``, ``name``, ``tags``, ``dir``...).

    The run is started by ``start()``, which ``init_trackers`` calls.

    Example:
        >>> accelerator = Accelerator(log_with="wandb", project_dir="runs")  # doctest: +SKIP
        >>> accelerator.init_trackers("exp", config={"lr": 3e-5},
        ...                           init_kwargs={"wandb": {"mode": "offline"}})  # doctest: +SKIP
    """

    name = "wandb"
    requires_logging_directory = False
    requires_packages = ("wandb",)
    install_command = _INSTALL

    def __init__(self, run_name: str, logging_dir: str | os.PathLike | None = None, **kwargs: Any) -> None:
        self.run_name = run_name
        self.logging_dir = logging_dir
        self.init_kwargs = kwargs
        self.run: Any = None

    def start(self) -> None:
        """Start the wandb run (``wandb.init``), its files under ``logging_dir/run_name/wandb``."""
        wandb = _import_wandb()
        kwargs = dict(self.init_kwargs)
        if self.logging_dir is not None and "dir" not in kwargs:
            folder = Path(self.logging_dir) / self.run_name
            folder.mkdir(parents=True, exist_ok=True)
            kwargs["dir"] = str(folder)
        kwargs.setdefault("settings", wandb.Settings(silent=True, console="off"))
        self.run = wandb.init(project=self.run_name, **kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def _started_run(self) -> Any:
        if self.run is None:
            raise not_started(self)
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Add ``values`` to the run's config."""
        self._started_run().config.update(values, allow_val_change=True)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log ``values`` (numbers, text, wandb media) as one history row at ``step``."""
        self._started_run().log(values, step=step, **kwargs)

    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log images (arrays, tensors or PIL images, by name) at ``step``."""
        import wandb

        self._started_run().log(
            {key: [wandb.Image(image) for image in images] for key, images in values.items()},
            step=step,
            **kwargs,
        )

    def log_table(
        self,
        table_name: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Log a table given as ``columns`` + ``data`` rows, or as a pandas ``dataframe``."""
        import wandb

        table = wandb.Table(columns=columns, data=data, dataframe=dataframe)
        self._started_run().log({table_name: table}, step=step, **kwargs)

    def finish(self) -> None:
        """Finish the run, then stop wandb's service process if no other run is open."""
        import wandb

        if self.run is None:
            return
        self.run.finish()
        if wandb.run is None:
            # Otherwise the service outlives the run until interpreter exit, and forked or os._exit()-ing
            # workers leave it behind for seconds.
            wandb.teardown()
