"""The errors expert parallelism raises, importable without torch.

They belong in :mod:`lockstep.errors` with every other error a user catches; they live here until that module
takes them (it was being reworked by another change when this folder was built), and this folder re-exports
them either way.
"""


class MoEModelNotSupportedError(ValueError):
    """The model holds no mixture-of-experts block that expert parallelism recognises."""


class ExpertShardingError(ValueError):
    """The experts of a block cannot be split evenly over the expert-parallel group."""


class ExpertParallelNotBuiltError(NotImplementedError):
    """A part of expert parallelism that lockstep does not build yet (see ``lockstep.layers.expert_parallel``)."""
