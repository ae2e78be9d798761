"""Accelerate's ``accelerate.launchers`` import path: the function launchers live in :mod:`lockstep.launcher`.

Example:
    >>> from lockstep.launchers import debug_launcher, notebook_launcher
    >>> notebook_launcher.__module__
    'lockstep.launcher.notebook'
"""

from lockstep.launcher.notebook import debug_launcher, notebook_launcher

__all__ = ["debug_launcher", "notebook_launcher"]
