"""What each worker process runs: the user's script, with its failure recorded for the launcher.

``python -m lockstep.launcher._worker [--module] [--function NAME] TARGET [ARGS...]`` runs TARGET as
``__main__`` (a script path, or a module with ``--module``); with ``--function NAME`` it imports TARGET
instead and calls ``NAME()`` (``lockstep launch --main-training-function``). If it raises, the exception and
traceback are written to the file the elastic agent names in ``TORCHELASTIC_ERROR_FILE`` (torch's
error-file format), so that the launcher can say which rank failed and why; then the exception propagates
as usual. With ``enable_cpu_affinity`` in the launch settings, the worker first pins itself to its share of
the cores. This module imports nothing heavy: a script that never imports torch starts as fast as under
torchrun.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import importlib.util
import io
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from types import FrameType, ModuleType
from typing import NoReturn

from lockstep import _env

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def write_error_file(error: BaseException) -> None:
    """Record ``error`` where the elastic agent looks for it (no-op outside the agent)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    from lockstep.diagnostics.records import write_whole  # here: keeps the bootstrap's imports light

    where = _user_location(error)
    record = {
        "message": {
            "message": f"{type(error).__name__}: {error}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(error)),
                "timestamp": str(int(time.time())),
                "lockstep_time": time.time(),
                "lockstep_location": where,
                "lockstep_pid": os.getpid(),
            },
        }
    }
    write_whole(path, record)  # on failure: reporting must never hide the user's own error


def _user_location(error: BaseException) -> str:
    """``file:line`` of the innermost frame of the user's code (not torch's or lockstep's), else the innermost."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not _is_bootstrap_frame(f)]
    library_dirs = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in _loaded_libraries())
    own = [f for f in frames if not f.filename.startswith(library_dirs)] if library_dirs else frames
    frame = (own or frames or [None])[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno}" if frame else ""


def _loaded_libraries() -> list[ModuleType]:
    return [
        sys.modules[name]
        for name in ("torch", "lockstep")
        if getattr(sys.modules.get(name), "__file__", None)
    ]


def _is_bootstrap_frame(frame: traceback.FrameSummary) -> bool:
    return "runpy" in frame.filename or "<frozen importlib" in frame.filename or frame.filename == __file__


def report_exception(error: BaseException) -> None:
    """Print the user's traceback (without this bootstrap's frames), prefixed by the rank."""
    prefix = f"[rank{os.environ.get('RANK', '?')}]: "
    summary = [f for f in traceback.extract_tb(error.__traceback__) if not _is_bootstrap_frame(f)]
    lines = ["Traceback (most recent call last):\n", *traceback.format_list(summary)]
    lines += traceback.format_exception_only(type(error), error)
    text = "".join(lines)
    sys.stderr.write("".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n")))
    sys.stderr.flush()
    _mark_failed()


def _mark_failed() -> None:
    """Tell lockstep's exit hook (if the script used lockstep) not to wait for the other ranks."""
    process_group = sys.modules.get("lockstep._process_group")
    if process_group is not None:
        process_group.mark_failed()  # type: ignore[attr-defined]


def _diagnose_hang(error: BaseException) -> None:
    """A collective timeout raised from torch's C++ (e.g. DDP's backward) becomes the hang report;
    the watchdog then ends the process with code 124. Returns for every other error."""
    hang_runtime = sys.modules.get("lockstep.diagnostics.active_watchdog")
    if hang_runtime is not None:
        hang_runtime.on_uncaught_exception(error)  # type: ignore[attr-defined]


def cpu_share(cpus: list[int], local_rank: int, local_world_size: int) -> list[int]:
    """The cores of local rank ``local_rank``: an equal, contiguous share of ``cpus`` (one core, shared
    round-robin, when there are fewer cores than workers).

    Example:
        >>> cpu_share([0, 1, 2, 3, 4], local_rank=1, local_world_size=2)
        [2, 3]
        >>> cpu_share([0, 1], local_rank=2, local_world_size=3)
        [0]
    """
    if len(cpus) < local_world_size:
        return [cpus[local_rank % len(cpus)]]
    share = len(cpus) // local_world_size
    return cpus[local_rank * share : (local_rank + 1) * share]


def pin_to_cpu_share() -> None:
    """Pin this worker to its share of the cores the launcher may use, when the launch asked for it."""
    if not _env.launch_settings().get("enable_cpu_affinity"):
        return
    cluster = _env.read_cluster_environment()
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cpu_share(cpus, cluster.local_rank, cluster.local_world_size))


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_with_the_launcher() -> None:
    """Have the kernel send this worker SIGTERM if its ``lockstep launch`` dies (Linux).

    Without it, a launcher killed with SIGKILL (the OOM killer, ``kill -9``) leaves its workers running,
    unwatched: torch's agent starts each one in a session of its own, so they survive their launcher's
    process group too. SIGTERM is the preemption signal: a loop that checks ``should_stop`` saves and exits,
    any other script ends. The launcher's pid, which it passes in ``LOCKSTEP_LAUNCHER_PID``, closes the race
    of a launcher that died before the request was made.
    """
    launcher = os.environ.get(_env.LAUNCHER_PID)
    if not launcher or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return  # no prctl: the worker outlives a killed launcher, as under torchrun
    if launcher not in _parents():
        os.kill(os.getpid(), signal.SIGTERM)


def _parents() -> list[str]:
    """The pids of this process's parent and grandparent: a worker's parent is the launcher, or the
    launcher's forkserver (:mod:`lockstep.launcher.preloaded`), which exits with the launcher."""
    parent = str(os.getppid())
    try:
        with open(f"/proc/{parent}/stat") as handle:  # "pid (comm) state ppid ...", comm may hold spaces
            grandparent = handle.read().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return [parent]
    return [parent, grandparent]


def _import_target(target: str, module: bool) -> ModuleType:
    """Import a module by name, or a script file as a module named after its file (not ``__main__``)."""
    if module:
        return importlib.import_module(target)
    name = os.path.splitext(os.path.basename(target))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.abspath(target))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {target!r} as a Python module")
    imported = importlib.util.module_from_spec(spec)
    sys.modules[name] = imported  # so that pickling its functions and classes finds them
    spec.loader.exec_module(imported)
    return imported


def _call_function(target: str, name: str, module: bool) -> None:
    function = getattr(_import_target(target, module), name, None)
    if not callable(function):
        raise ValueError(
            f"{target} has no function named {name!r}: define it, or pass the name of your training function "
            "to --main-training-function."
        )
    function()


def _parse_options(argv: list[str]) -> tuple[bool, str | None, list[str]]:
    """(module, function, the rest) from the bootstrap's leading options."""
    module, function = False, None
    while argv and argv[0] in ("--module", "--function"):
        if argv[0] == "--module":
            module, argv = True, argv[1:]
        else:
            function, argv = argv[1], argv[2:]
    return module, function, argv


def _run_target(target: str, module: bool, function: str | None) -> None:
    if not module:
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` does
    if function is not None:
        _call_function(target, function, module)
    elif module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")


def run(argv: list[str]) -> None:
    module, function, argv = _parse_options(argv)
    if not argv:
        raise SystemExit("lockstep worker: nothing to run")
    target, args = argv[0], argv[1:]
    sys.argv = [target, *args]
    print_whole_lines()
    stop_with_the_launcher()
    try:
        pin_to_cpu_share()
        _run_target(target, module, function)
    except SystemExit as exit_request:
        if exit_request.code not in (None, 0):
            write_error_file(exit_request)
            _mark_failed()
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as error:
        _diagnose_hang(error)
        write_error_file(error)
        report_exception(error)
        sys.exit(1)


def run_forked(*argv: str) -> None:
    """:func:`run` in a worker that torch's agent forked from the launcher's preloaded server
    (:mod:`lockstep.launcher.preloaded`), made to behave as the fresh ``python -u`` interpreter it stands
    for: the server's objects out of its garbage collector's reach, a session of its own (a terminal's
    Ctrl-C reaches the launcher, which stops the workers), output streams of its own (then written a line
    at a time by :func:`run`), and at the end what an interpreter's exit does and a multiprocessing
    child's ``os._exit`` skips: wait for the script's non-daemon threads, then run its ``atexit``
    handlers."""
    _leave_the_servers_objects_to_it()
    os.setsid()
    _report_success_before_os_exit(sys._getframe(1))
    _let_the_server_end_with_the_launcher()
    _reseed_numpy()
    _own_output_streams()
    try:
        run(list(argv))
    finally:
        _exit_like_an_interpreter()


def _report_success_before_os_exit(caller: FrameType | None) -> None:
    """Make ``os._exit(0)`` in the script count as success. torch's agent takes a forked worker as done
    once its entry point has returned a value through a queue; a script that ends with ``os._exit(0)``
    (to skip a slow teardown) never returns, and the launch waited forever. The queue is a local of
    torch's wrapper that called :func:`run_forked` (``ret_val_``, torch 2.x); where it is not found,
    nothing changes."""
    while caller is not None and "ret_val_" not in caller.f_locals:
        caller = caller.f_back
    if caller is None:
        return
    queue, leave = caller.f_locals["ret_val_"], os._exit

    def exit_reporting_success(code: int) -> NoReturn:
        if code == 0:
            queue.put(None)
        leave(code)

    os._exit = exit_reporting_success


def _leave_the_servers_objects_to_it() -> None:
    """Freeze what the server imported (:func:`gc.freeze`, as CPython's documentation advises for a process
    forked without exec): the worker's full collections then never walk torch's objects, which a fresh
    interpreter's would, nor write to each one's collector header, which copied the page it sits on out
    of the memory the workers share with the server. Freezing moves a list head; nothing is copied."""
    gc.freeze()


def _let_the_server_end_with_the_launcher() -> None:
    """Close this worker's copy of the forkserver's keep-alive pipe, which multiprocessing hands to every
    child: the server ends when the launcher's copy closes (the launcher died), and its end sends this
    worker SIGTERM (:func:`stop_with_the_launcher`); while a worker kept the pipe open, a SIGKILLed
    launcher left the server and its workers running."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # type: ignore[attr-defined]
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        server._forkserver_alive_fd = None


def _reseed_numpy() -> None:
    """Give numpy's global generator fresh entropy, as a fresh interpreter's import does: forked from
    the server, every worker would otherwise draw the same unseeded ``np.random`` numbers (Python's
    ``random`` reseeds itself after a fork; torch's default seed is the same in every process anyway)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _own_output_streams() -> None:
    """New ``sys.stdout``/``sys.stderr`` over this worker's file descriptors 1 and 2 (the server's stream
    objects were built for the server's own output)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:
            continue
        stream.flush()
        raw = io.FileIO(stream.fileno(), "w", closefd=False)
        setattr(sys, name, io.TextIOWrapper(raw, encoding=stream.encoding, errors=stream.errors))


def print_whole_lines() -> None:
    """Write the worker's output a whole line at a time, as soon as the line ends.

    Workers run as ``python -u`` (as under torchrun), and an unbuffered ``print`` writes its text and its
    newline in two calls: two ranks sharing the launcher's terminal or pipe then merged lines ("LINE 1 ...
    LINE 0 ...", then an empty line), 860 to 3,864 of 6,000 lines in two runs of two ranks printing
    3,000 lines each. Line-buffered, a stream keeps a line's pieces until its end and sends the line in
    one write, which a pipe or terminal keeps whole (up to 4 KiB). A line still appears the moment it ends,
    and ``\r`` (progress bars) or ``flush()`` sends a partial one; text without an end waits for it.
    """
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.flush()
            stream.reconfigure(line_buffering=True, write_through=False)


def _exit_like_an_interpreter() -> None:
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()


if __name__ == "__main__":
    run(sys.argv[1:])
