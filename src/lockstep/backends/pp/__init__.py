"""Pipeline parallelism (``ParallelismConfig(pp_size > 1)``) on ``torch.distributed.pipelining``."""

from lockstep.backends.pp.backend import PipelineBackend
from lockstep.backends.pp.model import PipelinedModel
from lockstep.backends.pp.transformers_models import causal_lm_loss

__all__ = ["PipelineBackend", "PipelinedModel", "causal_lm_loss"]
