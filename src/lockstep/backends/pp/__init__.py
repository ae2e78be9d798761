"""Pipeline parallelism (``ParallelismConfig(pp_size > 1)``) on ``torch.distributed.pipelining``."""

from lockstep.backends.pp.backend import PipelineBackend
from lockstep.backends.pp.model import PipelinedModel

__all__ = ["PipelineBackend", "PipelinedModel"]
