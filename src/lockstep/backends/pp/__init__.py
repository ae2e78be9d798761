"""Pipeline parallelism (``ParallelismConfig(pp_size > 1)``) on ``torch.distributed.pipelining``.

The public names load on first use: the package itself stays torch-free, so that its ``spec`` (the
backend's vocabulary) can be read by the launcher.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "PipelineBackend": "lockstep.backends.pp.backend",
    "PipelinedModel": "lockstep.backends.pp.model",
    "causal_lm_loss": "lockstep.backends.pp.transformers_models",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lockstep.backends.pp' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
