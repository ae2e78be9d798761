"""Strategies for distributing a model: one class per way, behind :class:`Backend`.

Each way to train is a folder here with a ``spec.py`` that registers its vocabulary
(:mod:`lockstep.config.backend_specs`); :func:`select_backend` asks the registered ones in turn. A user
adds a backend from their own code with :func:`register_backend` (see its docstring).

This package imports nothing heavy on its own: ``lockstep launch`` reads the specs without torch.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Backend": "lockstep.backends.base",
    "DataShard": "lockstep.backends.base",
    "BackendRequest": "lockstep.config.backend_specs",
    "BackendSpec": "lockstep.config.backend_specs",
    "Capability": "lockstep.backends.capabilities",
    "ContextParallel": "lockstep.backends.capabilities",
    "JointPreparation": "lockstep.backends.capabilities",
    "PipelineSchedule": "lockstep.backends.capabilities",
    "ShardedCheckpointIO": "lockstep.backends.capabilities",
    "TrainingStateTransfer": "lockstep.backends.capabilities",
    "DDPBackend": "lockstep.backends.ddp.backend",
    "SingleProcessBackend": "lockstep.backends.single.backend",
    "register_backend": "lockstep.backends.registry",
    "select_backend": "lockstep.backends.registry",
    "unregister_backend": "lockstep.backends.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lockstep.backends' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
