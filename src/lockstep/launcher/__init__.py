"""Starting workers: ``lockstep launch`` (scripts) and the notebook/debug launchers (functions)."""

from lockstep.launcher.notebook import debug_launcher, notebook_launcher

__all__ = ["debug_launcher", "notebook_launcher"]
