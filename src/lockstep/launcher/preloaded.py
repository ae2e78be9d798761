"""Workers forked from a process that has already imported torch, instead of fresh interpreters.

Every fresh worker interpreter pays for ``import torch`` and, at its first optimizer, for ``torch._dynamo``
(measured here: about 1 CPU-second each on an idle core, 2-3 under load), and keeps a private copy of those
modules' memory. ``lockstep launch`` instead asks torch's elastic agent to start the workers with
multiprocessing's ``forkserver`` method, the server preloading :data:`PRELOADED_MODULES` once: each worker is
a fork of it, running the same bootstrap (``lockstep.launcher._worker``) as a fresh interpreter would, so
the script still runs as ``__main__`` with its own ``sys.argv``, environment, session and error record.

What stays different from a fresh interpreter, and how it is kept equivalent:

- the worker is a multiprocessing child, which leaves with ``os._exit``: the bootstrap runs the exit
  handlers the script registered (``atexit``) and flushes its streams itself;
- the modules above are imported before the script runs, with the launcher's environment: a script that
  sets a variable torch reads at import time (``TORCH_LOGS``, ``TORCH_CPP_LOG_LEVEL``, ...) before importing
  torch needs ``LOCKSTEP_FRESH_WORKERS=1``, which starts every worker as a fresh interpreter as before.

``--no-python`` targets and a second launch from one process with another environment (the forkserver
keeps the environment it started with) also get fresh interpreters.
"""

from __future__ import annotations

import os
from typing import Any

FRESH_WORKERS = "LOCKSTEP_FRESH_WORKERS"
"""``1`` starts each worker as a fresh interpreter (``python -u -m lockstep.launcher._worker ...``)."""

PRELOADED_MODULES = ("lockstep.launcher._worker", "torch", "torch.distributed", "torch._dynamo", "lockstep")
"""What the forkserver imports once for every worker (``torch._dynamo``: the first optimizer imports it)."""

_server_environment: dict[str, str] | None = None
"""The environment the forkserver of this process started with, once it has."""


def fresh_workers_requested(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get(FRESH_WORKERS, "").strip().lower() in {"1", "true", "yes", "on"}


def can_preload() -> bool:
    """Whether this launch can fork its workers from the preloaded server: not asked otherwise, and this
    process has no forkserver yet or one started with the same environment."""
    if fresh_workers_requested():
        return False
    return _server_environment is None or _server_environment == dict(os.environ)


def preloaded_start() -> tuple[Any, str]:
    """Start the forkserver (it imports :data:`PRELOADED_MODULES` while the launcher goes on) and return
    the worker entry point and start method for torch's agent. Call it once the workers' environment is
    set: the server and every worker forked from it start with this process's environment."""
    import multiprocessing
    from multiprocessing import forkserver

    global _server_environment
    from lockstep.launcher import _worker

    multiprocessing.set_forkserver_preload(list(PRELOADED_MODULES))
    forkserver.ensure_running()
    _server_environment = dict(os.environ)
    return _worker.run_forked, "forkserver"
