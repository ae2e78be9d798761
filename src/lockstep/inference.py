"""``accelerate.inference``: the name ``prepare_pippy``, for pipeline-parallel inference lockstep lacks.

Example:
    >>> prepare_pippy(object())
    Traceback (most recent call last):
    NotImplementedError: prepare_pippy is not supported by lockstep: pipeline-parallel inference (PiPPy, torch.distributed.pipelining) is not built. Run the whole model on each process and give each its share of the inputs with accelerator.split_between_processes(...).
"""

from __future__ import annotations

from lockstep.utils._unsupported import Feature, unsupported_function

__all__ = ["prepare_pippy"]

PIPELINE_INFERENCE = Feature(
    "pipeline-parallel inference (PiPPy, torch.distributed.pipelining) is not built",
    "Run the whole model on each process and give each its share of the inputs with "
    "accelerator.split_between_processes(...).",
)

prepare_pippy = unsupported_function("prepare_pippy", PIPELINE_INFERENCE)
prepare_pippy.__module__ = __name__
