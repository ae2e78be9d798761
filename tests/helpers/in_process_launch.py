"""Running a launched script in workers forked from the test process instead of ``lockstep launch``."""

from __future__ import annotations

import os


def _run_script(script: str, args: list[str]) -> str:
    """In a worker of :func:`run_distributed`: run ``script`` as ``__main__`` and return what it printed."""
    import contextlib
    import io
    import runpy
    import sys

    saved, out = sys.argv, io.StringIO()
    sys.argv = [script, *args]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = saved
    return out.getvalue()


def launched_in_process(
    launch_flags: list[str], script: str, args: list[str], timeout: float = 180, **extra_env: str
) -> list[str]:
    """Each rank's output of ``lockstep launch LAUNCH_FLAGS SCRIPT ARGS`` run in workers forked from this
    process instead of a launch: the launch flags resolve to the worker environment the launcher would
    set, and the workers run the script as ``__main__``. It costs no ``import torch`` (or DeepSpeed, with
    the ``deepspeed_preloaded`` fixture) per process, for an uninterrupted reference run whose launch is
    not what a test claims."""
    from lockstep.cli.launch_cmd import load_settings
    from lockstep.cli.main import build_parser
    from lockstep.launcher.elastic import prepare_worker_environment
    from tests.helpers.cli import cli_env
    from tests.helpers.multiprocess import run_distributed

    parsed = build_parser().parse_args(["launch", *launch_flags, script, *args])
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(cli_env())  # the launch's environment: no user config file, no cluster variables
    try:
        settings = load_settings(parsed)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    env: dict[str, str] = {}
    prepare_worker_environment(settings, env)
    env.pop("OMP_NUM_THREADS", None)  # run_distributed gives each worker one thread
    return run_distributed(
        _run_script, settings.num_processes, script, args, env={**env, **extra_env}, timeout=timeout
    )
