"""``lockstep launch [flags] script.py [script args]``: run a script on any topology.

Flags take both spellings (``--num-processes`` and Accelerate's ``--num_processes``); every flag of
``accelerate launch`` is understood, and those for hardware and services lockstep does not drive are
refused with one line (see :mod:`lockstep.cli.launch_flags`). Settings resolve as flag > cluster
environment (SLURM, Kubeflow, MPI, LSF, PBS: see :mod:`lockstep.launcher.clusters`) > config file
(``--config-file``, else the default file if it exists) > default. Processes are started by torch's elastic
agent (the engine behind torchrun), in this process.

How the target runs: as a script (``python script.py``), as a module (``-m``/``--module``), as a program
of its own (``--no-python``: a shell script or binary, run directly), or by calling one function of it
(``--main-training-function main``: the script is imported, not run as ``__main__``, and ``main()`` is
called in every worker, as a notebook cell's function would be).

Unlike ``accelerate launch --cpu --num_processes 2`` (which starts one process), on a CPU-only machine
``lockstep launch --num-processes 2`` starts two gloo processes that form one group.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from lockstep.cli._unsupported_flags import EPILOG
from lockstep.cli.launch_flags import (
    BACKEND_FLAGS,
    LAUNCH_FLAGS,
    Flag,
    add_launch_flags,
    given_flags,
    table_flags,
)
from lockstep.errors import UsageError

__all__ = [
    "BACKEND_FLAGS",
    "LAUNCH_FLAGS",
    "Flag",
    "add_launch_flags",
    "cluster_summary",
    "given_flags",
    "load_settings",
    "register",
    "run_launch",
    "table_flags",
]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "launch", help="run a training script on one or many processes/machines", epilog=EPILOG
    )
    add_launch_flags(parser)
    parser.add_argument("-m", "--module", action="store_true", help="run TARGET as a module (python -m)")
    parser.add_argument(
        "--no-python",
        "--no_python",
        dest="no_python",
        action="store_true",
        help="run TARGET as a program of its own (a shell script or binary), not with python",
    )
    parser.add_argument(
        "--main-training-function",
        "--main_training_function",
        dest="main_training_function",
        metavar="NAME",
        help="import TARGET and call its function NAME() in every worker, instead of running it as __main__",
    )
    parser.add_argument("target", metavar="script.py", help="the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(handler=run_launch)


def load_settings(args: argparse.Namespace) -> Any:
    """Resolve flags + config file into LaunchSettings (UsageError on bad input); warn about settings that
    have no effect here."""
    from lockstep.config.file import ConfigFileError, default_config_path, load_config_file
    from lockstep.launcher.clusters import detect_cluster
    from lockstep.launcher.settings import resolve

    flags = given_flags(args)
    path = flags.pop("config_file", None)
    if path is None and default_config_path().is_file():
        path = str(default_config_path())
    file_config = None
    if path is not None:
        if not os.path.isfile(path):
            raise UsageError(f"--config-file {path!r} does not exist.")
        try:
            file_config = load_config_file(path)
        except ConfigFileError as error:
            raise UsageError(str(error)) from None
    cluster = detect_cluster(os.environ, choice=flags.get("cluster", "auto"))
    settings = resolve(flags, file_config, path, cluster=cluster)
    for note in settings.notes():
        print(f"lockstep {getattr(args, 'command', 'launch')}: warning: {note}", file=sys.stderr)
    return settings


def check_target(args: argparse.Namespace, settings: Any) -> None:
    """Check how the target is to run before any worker starts.

    Raises:
        UsageError: contradicting target flags, a missing script or program, or a script without the
            function ``--main-training-function`` names.
    """
    if args.no_python:
        _check_program(args, settings)
    elif not args.module and not os.path.isfile(args.target):
        raise UsageError(f"script {args.target!r} does not exist.")
    if args.main_training_function is not None and not args.module:
        _check_function_defined(args.target, args.main_training_function)


def _check_program(args: argparse.Namespace, settings: Any) -> None:
    """``--no-python``: TARGET must be an executable file or a command on PATH, and run without lockstep's
    Python bootstrap."""
    for other, given in (
        ("--module", args.module),
        ("--main-training-function", args.main_training_function is not None),
        ("--enable-cpu-affinity", settings.enable_cpu_affinity),
    ):
        if given:
            raise UsageError(
                f"--no-python cannot be combined with {other}: --no-python runs {args.target!r} as a program of "
                f"its own, and {other} needs lockstep's Python bootstrap in each worker."
            )
    if os.path.isfile(args.target) and not os.access(args.target, os.X_OK):
        raise UsageError(
            f"--no-python: {args.target!r} is not executable; run `chmod +x {args.target}`, or drop "
            "--no-python to run it with python."
        )
    if shutil.which(args.target) is None and not os.path.isfile(args.target):
        raise UsageError(f"--no-python: {args.target!r} is neither a file nor a command on PATH.")


def _check_function_defined(path: str, name: str) -> None:
    """``--main-training-function NAME``: the script must define NAME at its top level (read, not run)."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)
    except (OSError, SyntaxError, ValueError):
        return  # the worker reports what is wrong with the script itself, with its rank and line
    defined: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            defined.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(target.id for target in targets if isinstance(target, ast.Name))
    if name not in defined:
        raise UsageError(
            f"--main-training-function {name!r}: {path} defines no function {name!r} at its top level. "
            "Pass the name of your training function."
        )


def cluster_summary(settings: Any) -> str:
    """One line saying what the cluster environment made of this launcher (printed on several machines).

    Example:
        >>> from lockstep.launcher.settings import LaunchSettings
        >>> cluster_summary(LaunchSettings(num_processes=4, num_machines=2, machine_rank=1, cluster="slurm",
        ...                                main_process_ip="gpu07", main_process_port=10731))
        'slurm job: machine 1 of 2, 2 processes here, rendezvous at gpu07:10731 (static)'
    """
    machine = f"machine {settings.machine_rank} of " if settings.rdzv_backend == "static" else "machines: "
    return (
        f"{settings.cluster} job: {machine}{settings.num_machines}, {settings.processes_per_machine} "
        f"process{'es' if settings.processes_per_machine > 1 else ''} here, rendezvous at "
        f"{settings.main_process_ip}:{settings.main_process_port} ({settings.rdzv_backend})"
    )


def run_launch(args: argparse.Namespace) -> int:
    from lockstep.launcher.elastic import launch

    settings = load_settings(args)
    check_target(args, settings)
    if settings.cluster != "none" and settings.num_machines > 1:
        print(f"lockstep launch: {cluster_summary(settings)}", file=sys.stderr)
    with contextlib.ExitStack() as services:
        _start_services(settings, services)
        return launch(
            settings,
            args.target,
            list(args.script_args),
            module=args.module,
            no_python=args.no_python,
            function=args.main_training_function,
        )


def _start_services(settings: Any, services: contextlib.ExitStack) -> None:
    """Start what a given add-on section runs beside the workers (fault tolerance's lighthouse); the workers
    get the section it yields."""
    from lockstep.config.backend_specs import sectioned_specs

    for spec in sectioned_specs():
        section = settings.sections.get(spec.config_section or "")
        if spec.add_on and spec.launch_service is not None and section is not None:
            service = spec.launch_service(dict(section), settings)
            settings.sections[spec.config_section] = services.enter_context(service)
