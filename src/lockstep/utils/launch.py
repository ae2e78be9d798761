"""``accelerate.utils.launch``: importable, not supported (lockstep does not launch on Amazon SageMaker).

Accelerate's other names in this module are internals of ``accelerate launch``; ``lockstep launch`` builds a
typed launch configuration for torch's elastic agent instead. Calling :func:`prepare_sagemager_args_inputs`
raises ``NotImplementedError``.
"""

from lockstep.utils.unsupported import prepare_sagemager_args_inputs

__all__ = ["prepare_sagemager_args_inputs"]
