"""Where a run keeps its files."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(kw_only=True)
class ProjectConfiguration:
    """Folders and checkpoint naming for a run.

    Example:
        >>> config = ProjectConfiguration(project_dir="runs/exp1", automatic_checkpoint_naming=True, total_limit=3)
        >>> config.logging_dir
        'runs/exp1'
    """

    project_dir: str | None = None
    """Root folder of the run (checkpoints go under ``project_dir/checkpoints``): a local path, or an fsspec
    URL such as ``s3://bucket/run`` (``pip install 'lockstep[s3]'``; ``[gcs]``, ``[azure]``)."""
    logging_dir: str | None = None
    """Folder for tracker files; defaults to ``project_dir``."""
    automatic_checkpoint_naming: bool = False
    """Name checkpoints ``checkpoint_{iteration}`` under ``project_dir/checkpoints``."""
    total_limit: int | None = None
    """Keep at most this many automatically named checkpoints (oldest removed first)."""
    iteration: int = 0
    """Number of the next automatically named checkpoint."""
    save_on_each_node: bool = False
    """Write the rank-0-only files on the local main process of every machine."""
    save_frozen_base: bool = False
    """``save_state`` of a peft model (adapters on a frozen base) writes its whole weights, base included, as
    Accelerate does. By default it writes only the trainable parameters (the adapter) and buffers, with a
    fingerprint of the frozen base that ``load_state`` checks (the base is rebuilt from its own files)."""

    def __post_init__(self) -> None:
        if self.project_dir is not None:
            self.project_dir = os.fspath(self.project_dir)
        if self.logging_dir is None:
            self.logging_dir = self.project_dir
        if self.total_limit is not None and self.total_limit < 1:
            raise ValueError(
                f"ProjectConfiguration(total_limit={self.total_limit}) is invalid: it must be >= 1, "
                "or None to keep every checkpoint."
            )
        if self.iteration < 0:
            raise ValueError(f"ProjectConfiguration(iteration={self.iteration}) is invalid: it must be >= 0.")

    def set_directories(self, project_dir: str | None = None) -> None:
        """Set ``project_dir`` and, when unset, ``logging_dir``."""
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir
