"""Accelerate's ``accelerate.scheduler`` import path: the prepared scheduler lives in :mod:`lockstep.accelerator`."""

from lockstep.accelerator.scheduler import AcceleratedScheduler

__all__ = ["AcceleratedScheduler"]
