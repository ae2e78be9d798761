"""What each worker process runs: the user's script, with its failure recorded for the launcher.

``python -m lockstep.launcher._worker [--module] TARGET [ARGS...]`` runs TARGET as ``__main__`` (a script
path, or a module with ``--module``). If it raises, the exception and traceback are written to the file
the elastic agent names in ``TORCHELASTIC_ERROR_FILE`` (torch's error-file format), so that the launcher
can say which rank failed and why; then the exception propagates as usual. This module imports nothing
heavy: a script that never imports torch starts as fast as under torchrun.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def write_error_file(error: BaseException) -> None:
    """Record ``error`` where the elastic agent looks for it (no-op outside the agent)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    user_frames = [f for f in traceback.extract_tb(error.__traceback__) if not _is_bootstrap_frame(f)]
    where = f"{os.path.basename(user_frames[-1].filename)}:{user_frames[-1].lineno}" if user_frames else ""
    record = {
        "message": {
            "message": f"{type(error).__name__}: {error}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(error)),
                "timestamp": str(int(time.time())),
                "lockstep_time": time.time(),
                "lockstep_location": where,
            },
        }
    }
    try:
        with open(path, "w") as handle:
            json.dump(record, handle)
    except OSError:
        pass  # reporting must never hide the user's own error


def _is_bootstrap_frame(frame: traceback.FrameSummary) -> bool:
    return "runpy" in frame.filename or frame.filename == __file__


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
    hang_runtime = sys.modules.get("lockstep.diagnostics.hang_watchdog")
    if hang_runtime is not None:
        hang_runtime.on_uncaught_exception(error)  # type: ignore[attr-defined]


def run(argv: list[str]) -> None:
    module = bool(argv) and argv[0] == "--module"
    if module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("lockstep worker: nothing to run")
    target, args = argv[0], argv[1:]
    sys.argv = [target, *args]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` does
            runpy.run_path(target, run_name="__main__")
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


if __name__ == "__main__":
    run(sys.argv[1:])
