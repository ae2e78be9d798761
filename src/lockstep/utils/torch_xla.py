"""``accelerate.utils.torch_xla``: importable, not supported (lockstep does not run on TPUs).

Calling :func:`install_xla` raises ``NotImplementedError``.
"""

from lockstep.utils.unsupported import install_xla

__all__ = ["install_xla"]
