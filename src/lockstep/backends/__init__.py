"""Strategies for distributing a model: one class per way, behind :class:`Backend`."""

from lockstep.backends.base import Backend
from lockstep.backends.ddp import DDPBackend
from lockstep.backends.registry import select_backend
from lockstep.backends.single import SingleProcessBackend

__all__ = ["Backend", "DDPBackend", "SingleProcessBackend", "select_backend"]
