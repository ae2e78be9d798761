"""lockstep's version, in a module of its own: the package's modules read it here, below the public
``lockstep`` namespace that re-exports it (a module inside the package never imports the package's top)."""

__version__ = "0.1.0"
