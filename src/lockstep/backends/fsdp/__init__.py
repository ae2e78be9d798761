"""Fully sharded data parallel training on torch's FSDP2 (``fully_shard``)."""

from lockstep.backends.fsdp.backend import FSDPBackend

__all__ = ["FSDPBackend"]
