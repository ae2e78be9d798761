"""Creating and tearing down the default process group.

Two torch traps are handled here, measured on torch 2.13 (docs/torch-notes.md, "Elastic restarts" and
"Abort at exit"):

* After an elastic restart a new gloo group can read the previous attempt's addresses from the shared
  store and fail with ``connectFullMesh ... Connection refused`` or hang. Every group is therefore built on
  a ``PrefixStore`` namespaced by ``TORCHELASTIC_RESTART_COUNT``.
* With a gloo group alive at interpreter exit, processes sometimes abort with ``terminate called without
  an active exception`` (pytorch/pytorch#190489). :func:`shutdown` tears the group down in an order that
  avoids it (collect garbage, barrier, destroy), and an exit hook calls it.
"""

from __future__ import annotations

import atexit
import gc
import logging
import sys
import threading
from datetime import timedelta
from types import TracebackType

import torch
import torch.distributed as dist

from lockstep._env import ClusterEnvironment

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=30)
EXIT_BARRIER_TIMEOUT = timedelta(seconds=60)
"""How long the exit hook waits for the other ranks before tearing down without them."""

_hook_registered = False
_uncaught_exception = threading.Event()


def init_default_group(
    cluster: ClusterEnvironment,
    *,
    backend: str,
    timeout: timedelta | None = None,
    init_method: str | None = None,
) -> None:
    """Join the job's default process group (no-op when one exists already).

    Args:
        cluster: the topology read from the environment.
        backend: ``gloo``, ``nccl``, ...
        timeout: collective timeout; 30 minutes when None.
        init_method: a URL that replaces the launcher's rendezvous (``tcp://...``, ``file://...``).
    """
    if dist.is_initialized():
        _register_exit_hook()  # a group the script made itself is also torn down safely at exit
        return
    timeout = timeout or DEFAULT_TIMEOUT
    if init_method is not None:
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=cluster.rank,
            world_size=cluster.world_size,
            timeout=timeout,
        )
    else:
        url = (
            "env://" if cluster.uses_env_rendezvous else f"tcp://{cluster.master_addr}:{cluster.master_port}"
        )
        store, rank, world_size = next(
            dist.rendezvous(url, rank=cluster.rank, world_size=cluster.world_size, timeout=timeout)
        )
        store = dist.PrefixStore(f"lockstep/attempt_{cluster.restart_count}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    _register_exit_hook()


def shutdown(*, barrier: bool = True) -> None:
    """Destroy the default process group safely; a no-op when there is none.

    Args:
        barrier: wait for every rank first. Pass False when this rank is failing, since the others may
            be blocked in a different collective.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()
    if barrier and dist.get_world_size() > 1:
        try:
            _bounded_barrier()
        except Exception as error:  # a peer died or is elsewhere: tearing down is all that is left to do
            logger.debug("barrier before destroy_process_group failed: %s", error)
    dist.destroy_process_group()
    gc.collect()


def _bounded_barrier() -> None:
    """A barrier that gives up after EXIT_BARRIER_TIMEOUT on gloo (a peer may be stuck elsewhere)."""
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=EXIT_BARRIER_TIMEOUT)
    else:
        dist.barrier()


def mark_failed() -> None:
    """Record that this process is exiting because of an error: skip the barrier at exit."""
    _uncaught_exception.set()


def _register_exit_hook() -> None:
    global _hook_registered
    if _hook_registered:
        return
    _hook_registered = True
    previous_hook = sys.excepthook

    def _note_uncaught(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        _uncaught_exception.set()
        previous_hook(kind, value, tb)

    sys.excepthook = _note_uncaught
    previous_exit = sys.exit

    def _note_exit_code(status: object = None) -> None:
        # sys.exit(3) reaches no excepthook; without this the exit hook would wait in a barrier for peers
        # that may be blocked in another collective.
        if status not in (None, 0):
            _uncaught_exception.set()
        previous_exit(status)

    sys.exit = _note_exit_code  # type: ignore[assignment]
    atexit.register(_shutdown_at_exit)


def _shutdown_at_exit() -> None:
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        shutdown(barrier=not _uncaught_exception.is_set())
    except Exception as error:  # never turn a clean exit into a crash
        logger.debug("process group shutdown at exit failed: %s", error)


def init_group_of_one(backend: str) -> None:
    """A default process group of this process alone (an in-memory store, no rendezvous), for engines that
    need a group even with one process (DeepSpeed); torn down at exit like any other. No-op when one exists."""
    if dist.is_initialized():
        return
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=DEFAULT_TIMEOUT)
    _register_exit_hook()
