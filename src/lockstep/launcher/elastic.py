"""Starting workers with torch's elastic agent (the engine behind torchrun), in this process.

``lockstep launch`` resolves its settings, then :func:`launch` builds a
``torch.distributed.launcher.api.LaunchConfig`` and hands the workers to ``elastic_launch``. Failures come
back as one readable line per failed rank instead of torch's generic banner.

Each worker runs ``python -m lockstep.launcher._worker [--module] [--function NAME] TARGET ARGS`` (see
:func:`worker_command`), or TARGET itself with ``no_python``; by default that bootstrap runs in a fork of a
server that has imported torch once for all workers (:mod:`lockstep.launcher.preloaded`). The settings reach the workers through the
environment (:func:`prepare_worker_environment`) and the agent's configuration (:func:`torch_launch_config`):
``role``, ``tee`` and ``log_dir`` become torch's log specs, ``rdzv_conf`` the rendezvous options.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

from lockstep import _env
from lockstep.launcher import preloaded
from lockstep.launcher.settings import LaunchSettings, cpu_threads_per_process

WORKER_MODULE = "lockstep.launcher._worker"


LOCAL_RENDEZVOUS = "lockstep-local"
"""The rendezvous backend of a one-machine launch given no port (see :func:`local_rendezvous_handler`)."""


def local_rendezvous_handler(params: Any) -> Any:
    """A static rendezvous whose store binds port 0 and keeps the socket: the port it got is the one the
    workers are told (``MASTER_PORT``), and they join that store (torch's agent store) instead of binding a
    port of their own.

    Picking a free port and binding it later (the former ``free_port()``) raced: between the two, another
    launch or test on the machine could take the port, and the launch failed with "address already in
    use". ``torchrun --standalone`` avoids it the same way (a c10d rendezvous on ``localhost:0``), with a
    random 0-0.3 s delay and heartbeats a one-machine launch does not need.
    """
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    class HeldPortRendezvous(StaticTCPRendezvous):
        def get_backend(self) -> str:
            return LOCAL_RENDEZVOUS

        def next_rendezvous(self) -> Any:
            if self._store is None:  # restarts (--max-restarts) keep the store, so the port, of the first try
                # not multi_tenant: that would hand a second launch in this process the first one's server
                self._store = TCPStore(self.master_addr, 0, self.world_size, True, self.timeout)
                self.master_port = self._store.port
            return super().next_rendezvous()

    address, _ = parse_rendezvous_endpoint(params.endpoint, 0)
    timeout = int(params.config.get("timeout", 600))
    return HeldPortRendezvous(address, 0, 0, 1, params.run_id, timeout)


def _register_local_rendezvous() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(LOCAL_RENDEZVOUS, local_rendezvous_handler)


def prepare_worker_environment(settings: LaunchSettings, environ: dict[str, str] | None = None) -> None:
    """Set what every worker inherits: the serialized settings, thread count and visible GPUs."""
    environ = os.environ if environ is None else environ  # type: ignore[assignment]
    environ[_env.LOCKSTEP_LAUNCH_CONFIG] = json.dumps(settings.worker_settings())
    environ[_env.LAUNCHER_PID] = str(os.getpid())  # torch's agent runs in this process: the workers' parent
    if settings.num_cpu_threads_per_process is not None:  # the flag beats the environment, as in Accelerate
        environ["OMP_NUM_THREADS"] = str(settings.num_cpu_threads_per_process)
    elif "OMP_NUM_THREADS" not in environ:
        threads = cpu_threads_per_process(settings.processes_per_machine, settings.cpus_per_machine)
        environ["OMP_NUM_THREADS"] = str(threads)
    if settings.gpu_ids not in (None, "all") and not settings.use_cpu:
        environ["CUDA_VISIBLE_DEVICES"] = str(settings.gpu_ids)
    if settings.use_cpu:
        environ["CUDA_VISIBLE_DEVICES"] = ""


AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"


def quiet_agent_logs() -> None:
    """Silence the agent's per-worker warnings and errors (our own report says it in a line per rank), but
    say when it restarts the workers (``--max-restarts``), which it logs only at INFO."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    import torch.distributed.elastic.agent.server.api  # noqa: F401  (it sets its logger's level on import)

    agent = logging.getLogger(AGENT_LOGGER)
    if not any(isinstance(handler, RestartNotice) for handler in agent.handlers):
        agent.addHandler(RestartNotice())
    agent.setLevel(logging.INFO)
    agent.propagate = False  # its other lines stay silent


class RestartNotice(logging.Handler):
    """Prints one line on stderr when the elastic agent restarts the workers.

    Example:
        >>> import io, contextlib
        >>> record = logging.LogRecord("agent", logging.INFO, "", 0,
        ...     "[%s] Worker group %s. %s/%s attempts left; will restart worker group", ("default", "FAILED", 1, 1), None)
        >>> with contextlib.redirect_stderr(io.StringIO()) as err:
        ...     RestartNotice().handle(record)
        True
        >>> print(err.getvalue().strip())
        lockstep launch: a worker failed; restarting all workers of this machine (restart 1 of 1).
    """

    def emit(self, record: logging.LogRecord) -> None:
        if not isinstance(record.msg, str) or "will restart worker group" not in record.msg:
            return
        if "attempts left" in record.msg and len(record.args or ()) == 4:
            _, state, left, most = record.args  # type: ignore[misc]
            why = "a worker failed" if state == "FAILED" else f"the workers were {str(state).lower()}"
            line = f"{why}; restarting all workers of this machine (restart {int(most) - int(left) + 1} of {most})"
        else:
            line = "machines joined; restarting the workers with them"
        print(f"lockstep launch: {line}.", file=sys.stderr, flush=True)


def torch_launch_config(settings: LaunchSettings, *, start_method: str = "spawn") -> Any:
    """The elastic agent's configuration for these settings (``fork`` lets notebook functions run)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    port, backend = settings.main_process_port, settings.rdzv_backend
    if port is None:  # one machine (several get 29500): the store binds port 0 and keeps it, no race
        port = 0
        if backend == "static":
            _register_local_rendezvous()
            backend = LOCAL_RENDEZVOUS
        # c10d binds the endpoint's port 0 itself, and shares a store on another port 0 with the workers
    endpoint = f"{settings.main_process_ip}:{port}"
    rdzv_configs: dict[str, Any] = dict(settings.rdzv_conf)
    if settings.rdzv_backend == "static":
        rdzv_configs["rank"] = settings.machine_rank  # the machine rank decides, whatever --rdzv-conf says
    return LaunchConfig(
        min_nodes=settings.min_num_machines or settings.num_machines,
        max_nodes=settings.num_machines,
        nproc_per_node=settings.processes_per_machine,
        run_id=f"lockstep-{port or os.getpid()}",
        role=settings.role,
        rdzv_endpoint=endpoint,
        rdzv_backend=backend,
        rdzv_configs=rdzv_configs,
        max_restarts=settings.max_restarts,
        monitor_interval=settings.monitor_interval,
        start_method=start_method,
        logs_specs=DefaultLogsSpecs(log_dir=settings.log_dir, tee=Std.from_str(settings.tee)),
        shutdown_timeout=30,  # workers stopped by a signal get this long to save a checkpoint
    )


def worker_command(
    target: str,
    args: list[str],
    *,
    module: bool = False,
    no_python: bool = False,
    function: str | None = None,
) -> tuple[str, list[str]]:
    """The program every worker runs and its arguments.

    Example:
        >>> worker_command("train.py", ["--lr", "0.1"], function="main")
        ('...python...', ['-u', '-m', 'lockstep.launcher._worker', '--function', 'main', 'train.py', '--lr', '0.1'])
        >>> worker_command("./run.sh", ["x"], no_python=True)  # doctest: +ELLIPSIS
        ('.../run.sh', ['x'])
    """
    if no_python:  # an executable of the user's: a path as given, else a command found on PATH
        return (os.path.abspath(target) if os.sep in target else target), list(args)
    options = [*(["--module"] if module else []), *(["--function", function] if function else [])]
    return sys.executable, ["-u", "-m", WORKER_MODULE, *options, target, *args]


def launch(
    settings: LaunchSettings,
    target: str,
    args: list[str],
    *,
    module: bool = False,
    no_python: bool = False,
    function: str | None = None,
) -> int:
    """Run ``target`` on every worker; returns the exit code.

    Args:
        settings: the resolved launch settings.
        target: a script, a module (``module=True``) or, with ``no_python``, an executable.
        args: the target's arguments.
        module: run ``target`` as ``python -m target``.
        no_python: run ``target`` itself instead of with Python.
        function: import the script or module and call this function of it in every worker, instead of
            running it as ``__main__`` (``--main-training-function``).
    """
    prepare_worker_environment(settings)
    program, program_args = worker_command(
        target, args, module=module, no_python=no_python, function=function
    )
    start_method = "spawn"
    modules = (
        []
        if no_python or not preloaded.can_preload()
        else preloaded.libraries_to_preload(target, module=module)
    )
    if modules:  # the bootstrap's own arguments follow its module name
        program_args = program_args[program_args.index(WORKER_MODULE) + 1 :]
        program, start_method = preloaded.preloaded_start(modules)  # it imports while this process does

    with imported_outside_garbage_collection():
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import elastic_launch

    quiet_agent_logs()
    try:
        elastic_launch(torch_launch_config(settings, start_method=start_method), program)(*program_args)
    except ChildFailedError as error:
        return report_failures(error.failures, quiet=settings.quiet)
    except Exception as error:
        stop = stopping_signal(error, SignalException)
        if stop is None:
            raise
        print(f"lockstep launch: received {stop.name}; the workers were stopped.", file=sys.stderr)
        return 128 + int(stop)
    return 0


@contextlib.contextmanager
def imported_outside_garbage_collection() -> Iterator[None]:
    """Import torch with the cyclic garbage collector paused, then move everything the import created out
    of its reach (:func:`gc.freeze`): torch's modules, functions and tables live as long as the launcher.

    With the collector running, importing torch's launch API in the launcher took 1,056 ms, of which three
    full collections walked the growing heap (11, 29 and 47-53 ms; torchrun's smaller start-up reached
    only two), and every later collection in a launcher that supervises a whole run would walk the same
    263,000 objects again. Paused: 885 ms. The price is the import's own cyclic garbage, frozen with it and
    never freed: 7,192 objects, 0.7 MB in this process only (not the workers)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def stopping_signal(error: BaseException, signal_exception: type[BaseException]) -> signal.Signals | None:
    """The signal that stopped the agent, where ``error`` is torch's ``SignalException`` or was raised while
    handling one. torch's agent turns SIGTERM into that exception wherever its handler interrupts the agent;
    landing between a metrics wrapper's entry and its timer it re-raises as an ``UnboundLocalError`` from
    the wrapper's ``finally`` (the workers are still stopped by the agent's own ``finally``)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, signal_exception):
            return signal.Signals(current.sigval)  # type: ignore[attr-defined]
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def describe_failure(rank: int, failure: Any) -> str:
    """One line saying which rank failed and why."""
    exitcode = int(failure.exitcode)
    head = f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid})"
    message = _recorded_exception(failure)
    raised = message is not None and not str(message.get("message", "")).startswith("SystemExit")
    if exitcode < 0 and not (raised and exitcode == -signal.SIGTERM):
        return f"{head} was killed by {failure.signal_name()} (exit code {exitcode})"
    if message is None:
        return f"{head} exited with code {exitcode}"
    location = message.get("extraInfo", {}).get("lockstep_location", "")
    text = str(message["message"]).strip().splitlines()[0]
    text = text if len(text) <= 240 else text[:237] + "..."
    # A rank that raised and was then stopped by the agent while exiting still failed with its exception.
    how = "failed" if exitcode < 0 else f"failed with exit code {exitcode}"
    return f"{head} {how}: {text}" + (f" ({location})" if location else "")


def _recorded_exception(failure: Any) -> dict[str, Any] | None:
    """The worker's recorded exception (torch fills the field with a placeholder when there is none)."""
    message = (failure.error_file_data or {}).get("message")
    return message if isinstance(message, dict) and message.get("message") else None


def _stopped_by_agent(message: str) -> bool:
    """A record of the agent's own SIGTERM: a forked worker inherits the agent's handler, which raises
    torch's ``SignalException`` in the worker, so the stop is recorded like an exception of the script."""
    return message.startswith("SignalException") and message.endswith(f"signal: {int(signal.SIGTERM)}")


def blame_order(item: tuple[int, Any]) -> tuple[int, float, int]:
    """Root cause first, earliest first within each kind.

    The agent stops the surviving workers with SIGTERM once one fails, so: a death by another signal
    (SIGKILL, SIGSEGV, ...) comes first, then an exception the worker raised, then a worker's own non-zero
    exit (often a SIGTERM handler), then workers the agent stopped.
    """
    rank, failure = item
    recorded = _recorded_exception(failure)
    if recorded and _stopped_by_agent(str(recorded.get("message", ""))):
        kind = 3
    elif failure.exitcode < 0 and failure.exitcode != -signal.SIGTERM:
        kind = 0
    elif recorded and not str(recorded.get("message", "")).startswith("SystemExit"):
        kind = 1
    elif recorded or failure.exitcode > 0:
        kind = 2
    else:
        kind = 3
    when = float((recorded or {}).get("extraInfo", {}).get("lockstep_time", failure.timestamp))
    return kind, when, rank


def report_failures(failures: dict[int, Any], *, quiet: bool = False) -> int:
    """Print each failed rank (root cause first; only that one when ``quiet``); returns the exit code."""
    hang = report_hang(failures)
    if hang is not None:
        return hang
    ordered = sorted(failures.items(), key=blame_order)
    for rank, failure in ordered[:1] if quiet else ordered:
        print(f"lockstep launch: {describe_failure(rank, failure)}", file=sys.stderr)
    if not quiet:
        print("lockstep launch: the other workers were stopped.", file=sys.stderr)
    if not ordered:
        return 1
    kind, first = blame_order(ordered[0])[0], int(ordered[0][1].exitcode)
    if kind == 1 and first < 0:
        return 1  # the root cause raised an exception; the signal only interrupted its exit
    return 128 - first if first < 0 else first or 1


def report_hang(failures: dict[int, Any]) -> int | None:
    """When the hang watchdog stopped the workers, print its one summary line; None otherwise."""
    from lockstep.diagnostics.hang_summary import HANG_EXIT_CODE
    from lockstep.diagnostics.records import hang_record

    hangs = {rank: hang_record(_recorded_exception(failure)) for rank, failure in failures.items()}
    reports = sorted((rank, record) for rank, record in hangs.items() if record is not None)
    if not reports:
        return None
    printer = next((record for _, record in reports if record.get("printer")), reports[0][1])
    summary = str(printer.get("summary", "")).removeprefix("lockstep: ")
    print(f"lockstep launch: {summary}", file=sys.stderr)
    print(f"lockstep launch: the workers were stopped (exit code {HANG_EXIT_CODE}).", file=sys.stderr)
    return HANG_EXIT_CODE
