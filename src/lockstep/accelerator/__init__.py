"""The Accelerator facade and the parts it composes (settings, prepared objects, checkpoints, trackers)."""

from lockstep.accelerator.facade import Accelerator

__all__ = ["Accelerator"]
