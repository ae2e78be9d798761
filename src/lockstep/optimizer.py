"""Accelerate's ``accelerate.optimizer`` import path: the prepared optimizer lives in :mod:`lockstep.accelerator`."""

from lockstep.accelerator.optimizer import AcceleratedOptimizer

__all__ = ["AcceleratedOptimizer"]
