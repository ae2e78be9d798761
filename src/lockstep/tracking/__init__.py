"""Experiment trackers: JSON lines (default, dependency-free), CSV, TensorBoard, and your own."""

from lockstep.tracking.base import GeneralTracker
from lockstep.tracking.files import CSVTracker, JSONLTracker

__all__ = ["CSVTracker", "GeneralTracker", "JSONLTracker"]
