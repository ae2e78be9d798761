"""Experiment trackers: JSON lines (default, dependency-free), CSV, TensorBoard, MLflow, wandb, and your own.

The tracker modules import their packages (``torch.utils.tensorboard``, ``mlflow``, ``wandb``) only when a
tracker starts, so importing this package does not need them installed. Your own tracker is a
``GeneralTracker`` subclass: pass an instance to ``log_with``, or register the class with
``register_tracker_class`` and name it in ``log_with`` or ``report_to``, as the built-in ones are.
"""

from __future__ import annotations

from lockstep.tracking.base import GeneralTracker, on_main_process
from lockstep.tracking.files import CSVTracker, JSONLTracker
from lockstep.tracking.mlflow import MLflowTracker
from lockstep.tracking.registry import (
    LOGGER_TYPE_TO_CLASS,
    filter_trackers,
    get_available_trackers,
    register_tracker_class,
)
from lockstep.tracking.tensorboard import TensorBoardTracker
from lockstep.tracking.wandb import WandBTracker

__all__ = [
    "LOGGER_TYPE_TO_CLASS",
    "CSVTracker",
    "GeneralTracker",
    "JSONLTracker",
    "MLflowTracker",
    "TensorBoardTracker",
    "WandBTracker",
    "filter_trackers",
    "get_available_trackers",
    "on_main_process",
    "register_tracker_class",
]
