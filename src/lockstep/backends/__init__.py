"""Strategies for distributing a model: one class per way, behind :class:`Backend`.

Each way to train is a folder here with a ``spec.py`` that registers its vocabulary
(:mod:`lockstep.config.backend_specs`); :func:`select_backend` asks the registered ones in turn. A user
adds a backend from their own code with :func:`register_backend` (see its docstring).

This package imports nothing heavy on its own: ``lockstep launch`` reads the specs without torch.
"""

from lockstep._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "Backend": "lockstep.backends.base",
        "DataShard": "lockstep.backends.base",
        "BackendRequest": "lockstep.config.backend_specs",
        "BackendSpec": "lockstep.config.backend_specs",
        "Capability": "lockstep.backends.capabilities",
        "ConfiguredOptimizer": "lockstep.backends.capabilities",
        "ContextParallel": "lockstep.backends.capabilities",
        "GatheredForward": "lockstep.backends.capabilities",
        "GlobalLossTerm": "lockstep.backends.capabilities",
        "JointPreparation": "lockstep.backends.capabilities",
        "LiveRecovery": "lockstep.backends.capabilities",
        "PipelineSchedule": "lockstep.backends.capabilities",
        "ShardedCheckpointIO": "lockstep.backends.capabilities",
        "TrainingStateTransfer": "lockstep.backends.capabilities",
        "DDPBackend": "lockstep.backends.ddp.backend",
        "SingleProcessBackend": "lockstep.backends.single.backend",
        "register_backend": "lockstep.backends.registry",
        "select_backend": "lockstep.backends.registry",
        "unregister_backend": "lockstep.backends.registry",
    },
)
