"""Pipeline parallelism (``ParallelismConfig(pp_size > 1)``) on ``torch.distributed.pipelining``.

The public names load on first use: the package itself stays torch-free, so that its ``spec`` (the
backend's vocabulary) can be read by the launcher.
"""

from lockstep._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "PipelineBackend": "lockstep.backends.pp.backend",
        "PipelinedModel": "lockstep.backends.pp.model",
        "causal_lm_loss": "lockstep.backends.pp.transformers_models",
    },
)
