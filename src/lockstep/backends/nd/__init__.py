"""N-D parallelism on a device mesh: tensor and context parallelism, FSDP2 and HSDP composed (``ParallelismConfig``)."""

from lockstep.backends.nd.backend import NDParallelBackend

__all__ = ["NDParallelBackend"]
