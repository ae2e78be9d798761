"""Every error a user of lockstep catches, importable without torch.

Each error is also re-exported where it is raised (``lockstep.config.file.ConfigFileError``,
``lockstep.checkpoint.CheckpointError``, ``lockstep.collectives.DistributedOperationException``,
``lockstep.layers.fault_tolerance.ReplicaQuorumError``), so either
import path works.
"""


class UsageError(ValueError):
    """Bad input on the command line or in a config file; the CLI prints it as one line, exit code 2."""


class ConfigFileError(ValueError):
    """A config file that cannot be read, or that holds a key or value lockstep cannot use."""


class CheckpointError(ValueError):
    """A checkpoint folder that is incomplete, corrupted or not a lockstep checkpoint."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds objects that ``torch.load(weights_only=True)`` refuses to unpickle."""


class DistributedOperationException(RuntimeError):
    """A collective was called with inputs that differ across processes (debug mode's shape check)."""


class ReplicaQuorumError(RuntimeError):
    """A fault-tolerant replica group could not reach torchft's lighthouse or get a step's quorum in time.

    Named apart from a hang of the group's own collectives: the message says which group, which lighthouse
    and what to do, and lockstep's hang report does not replace it."""


class CannotPadNestedTensorWarning(UserWarning):
    """``pad_across_processes`` met a nested tensor (``torch.nested``) and left it unpadded."""


class NotATrackerClassError(TypeError, ValueError):
    """``register_tracker_class`` was given something that is not a ``GeneralTracker`` subclass.

    A ``TypeError`` (a wrong kind of argument) that is also the ``ValueError`` Accelerate raises there.
    """
