"""Accelerate's ``accelerate.inference`` import path: ``prepare_pippy`` (pipelined inference) lives in
:mod:`lockstep.big_model.pipeline_inference`.

Example:
    >>> from lockstep.inference import prepare_pippy
    >>> prepare_pippy.__module__
    'lockstep.big_model.pipeline_inference'
"""

from lockstep.big_model.pipeline_inference import prepare_pippy

__all__ = ["prepare_pippy"]
