"""Experiment trackers: JSON lines (default, dependency-free), CSV, TensorBoard, MLflow, wandb, and your own.

The trackers that need a package (``TensorBoardTracker``, ``MLflowTracker``, ``WandBTracker``) are imported
on first use, so that importing this package does not need them installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lockstep.tracking.base import GeneralTracker
from lockstep.tracking.files import CSVTracker, JSONLTracker

_OPTIONAL_EXPORTS = {
    "MLflowTracker": "lockstep.tracking.mlflow",
    "TensorBoardTracker": "lockstep.tracking.tensorboard",
    "WandBTracker": "lockstep.tracking.wandb",
}

if TYPE_CHECKING:
    from lockstep.tracking.mlflow import MLflowTracker
    from lockstep.tracking.tensorboard import TensorBoardTracker
    from lockstep.tracking.wandb import WandBTracker


def __getattr__(name: str) -> Any:
    module = _OPTIONAL_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lockstep.tracking' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "CSVTracker",
    "GeneralTracker",
    "JSONLTracker",
    "MLflowTracker",
    "TensorBoardTracker",
    "WandBTracker",
]
