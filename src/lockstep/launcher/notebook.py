"""Starting a Python function on several processes: from a notebook, or for tests.

Both launchers hand the processes to torch's elastic agent with the ``fork`` start method, so functions
defined in a notebook (which cannot be pickled) work. A failing worker's exception text is raised in the
calling process, as a :class:`~lockstep.launcher.failures.WorkerFailedError` (torch's ``ChildFailedError``,
as Accelerate raises, and a ``RuntimeError``).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from lockstep import _env
from lockstep.launcher.elastic import quiet_agent_logs, torch_launch_config
from lockstep.launcher.settings import LaunchSettings, cpu_threads_per_process

DEFAULT_PORT = 29500
"""``use_port``'s default (Accelerate's); on one machine it means: any free port."""


def _fresh_process_entry(function: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``function`` to run in a forked worker after forgetting the parent's lockstep state."""

    @functools.wraps(function)
    def entry(*args: Any) -> Any:
        import gc

        from lockstep import _process_group
        from lockstep.state import GradientState, PartialState

        # Objects copied from the parent (a notebook, with threads of its own) are never collected here:
        # their finalizers could wait for locks that a parent thread held at the moment of the fork.
        gc.freeze()
        _free_output_locks()
        PartialState._reset_state()
        GradientState._reset_state()
        try:
            result = function(*args)
        except Exception as error:
            _process_group.mark_failed()
            _exit_after_failure(error)
        except BaseException:
            _process_group.mark_failed()
            raise
        _process_group.shutdown(barrier=True)
        return result

    return entry


def _free_output_locks() -> None:
    """Give a Jupyter kernel's output streams new locks in a forked worker.

    ipykernel's ``sys.stdout``/``sys.stderr`` guard their buffers with a lock that the kernel's IOPub
    thread takes while it sends output. A worker forked at that moment inherits the lock taken, by a thread
    that does not exist in the worker, and its first ``print`` (or the report of its error) waited forever,
    and with it the launch: a rank that failed in a notebook cell once hung the cell for the test's whole
    180 s. The worker has one thread, so a new, free lock is the right state; other streams are untouched.
    """
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "_buffer_lock"):
            stream._buffer_lock = threading.RLock()  # type: ignore[union-attr]


def _exit_after_failure(error: Exception) -> NoReturn:
    """Record ``error`` for the launcher, print it, and end this worker at once.

    No teardown: the record is written before this process's connections close, so the other ranks' broken
    collectives (which follow) are recorded later and the launcher names this rank as the cause. Exiting
    directly also keeps torch's handler from replacing the record with one lacking lockstep's fields.
    """
    from lockstep.launcher._worker import report_exception, write_error_file

    write_error_file(error)
    report_exception(error)
    sys.stdout.flush()
    os._exit(1)


def _run_forked(
    function: Callable[..., Any], args: tuple, launch_settings: LaunchSettings, *, settings: dict[str, Any]
) -> None:
    import json

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    config = torch_launch_config(launch_settings, start_method="fork")
    threads = str(cpu_threads_per_process(launch_settings.num_processes // launch_settings.num_machines))
    environment = {
        _env.LOCKSTEP_LAUNCH_CONFIG: json.dumps(settings),
        _env.FORK_LAUNCHED: "1",  # PartialState().fork_launched, as in Accelerate
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads),
    }
    quiet_agent_logs()
    with _env.patched(environment):
        try:
            elastic_launch(config, _fresh_process_entry(function))(*args)
        except ChildFailedError as error:
            from lockstep.launcher.failures import WorkerFailedError, with_every_recorded_failure

            raise WorkerFailedError(error.name, with_every_recorded_failure(error.failures)) from None


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str = str(DEFAULT_PORT),
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
) -> None:
    """Run ``function(*args)`` on ``num_processes`` processes from a notebook (CPU or GPU).

    Args:
        function: the training function; it creates its own Accelerator.
        args: positional arguments for it.
        num_processes: processes on this machine (default: the number of GPUs, else 1).
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"`` for the Accelerator.
        use_port: rendezvous port. On a single machine the default, or a port that is busy, is replaced by a
            free port the launcher's store binds and keeps.
        master_addr: address of machine 0 for several machines.
        node_rank: rank of this machine.
        num_nodes: number of machines.
        rdzv_backend: ``static`` or ``c10d``.
        max_restarts: restart all workers this often after a failure.
        monitor_interval: seconds between health checks of the workers.

    Example:
        >>> def training_loop():
        ...     accelerator = Accelerator()
        ...     ...
        >>> notebook_launcher(training_loop, num_processes=2)  # doctest: +SKIP
    """
    import torch

    from lockstep.precision import parse_mixed_precision

    parse_mixed_precision(mixed_precision)
    if num_processes is None:
        num_processes = torch.cuda.device_count() if torch.cuda.is_available() else 1
    if num_processes < 1:
        raise ValueError(f"notebook_launcher(num_processes={num_processes}) is invalid: it must be >= 1.")
    if torch.cuda.is_available() and torch.cuda.is_initialized() and num_processes > 1:
        raise RuntimeError(
            "CUDA has been initialized in this notebook before notebook_launcher was called, and forked "
            "processes cannot use it. Restart the kernel and make sure no cell touches CUDA (model.cuda(), "
            "torch.cuda.*, an Accelerator) before calling notebook_launcher."
        )
    settings = {"mixed_precision": str(mixed_precision)}
    if num_processes == 1 and num_nodes == 1:
        with _env.patched({_env.LOCKSTEP_LAUNCH_CONFIG: __import__("json").dumps(settings)}):
            _fresh_process_entry(function)(*args)
        return
    launch_settings = LaunchSettings(
        num_processes=num_processes * num_nodes,
        num_machines=num_nodes,
        machine_rank=node_rank,
        main_process_ip=master_addr,
        main_process_port=_usable_port(use_port, num_nodes),
        rdzv_backend=rdzv_backend,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
    )
    _run_forked(function, args, launch_settings, settings=settings)


def _usable_port(use_port: str | int, num_nodes: int) -> int | None:
    """The rendezvous port. None lets the launcher's store bind port 0 and keep it (no other process can
    take the port between its choice and its use): on one machine with the default port, or with a given
    port another program holds. Several machines use the port given."""
    port = int(use_port)
    if num_nodes > 1:
        return port
    if port == DEFAULT_PORT:
        return None
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return None
    return port


def debug_launcher(function: Callable[..., Any], args: tuple = (), num_processes: int = 2) -> None:
    """Run ``function(*args)`` on ``num_processes`` CPU processes (for tests and debugging).

    Example:
        >>> debug_launcher(training_loop, num_processes=2)  # doctest: +SKIP
    """
    if num_processes < 1:
        raise ValueError(f"debug_launcher(num_processes={num_processes}) is invalid: it must be >= 1.")
    _run_forked(function, args, LaunchSettings(num_processes=num_processes), settings={"use_cpu": True})
    sys.stdout.flush()
