"""``lockstep env``: versions, devices, backends, trackers and the default config, for bug reports."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
from collections.abc import Mapping
from typing import Any

from lockstep.errors import UsageError

# The trackers' packages are listed with the trackers (tracker_report), from the tracker table.
# The backends' packages are listed with the backends (backend_report), from the backend specs.
OPTIONAL_PACKAGES = ("numpy", "safetensors", "transformers", "tqdm")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "env", help="print versions, devices and the default config (for bug reports)"
    )
    parser.add_argument("--config-file", "--config_file", dest="config_file", help="config file to show")
    parser.set_defaults(handler=run_env)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        pass
    # A module whose distribution has another name (mlflow from mlflow-skinny).
    for distribution in importlib.metadata.packages_distributions().get(package, []):
        return importlib.metadata.version(distribution)
    return "not installed"


def environment_report(config_file: str | None = None) -> list[tuple[str, str]]:
    """(name, value) lines describing this machine and installation."""
    import torch
    import torch.distributed as dist

    from lockstep._version import __version__
    from lockstep.config.file import default_config_path

    lines = [
        ("lockstep", __version__),
        ("Python", sys.version.split()[0]),
        ("Platform", platform.platform()),
        ("torch", torch.__version__),
        ("CPU cores", str(os.cpu_count())),
        ("CUDA available", f"{torch.cuda.is_available()} ({torch.cuda.device_count()} devices)"),
        ("MPS available", str(torch.backends.mps.is_available())),
        (
            "gloo / nccl / mpi",
            " / ".join(
                str(check())
                for check in (dist.is_gloo_available, dist.is_nccl_available, dist.is_mpi_available)
            ),
        ),
        ("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "unset")),
    ]
    if torch.cuda.is_available():
        lines += [(f"GPU {i}", torch.cuda.get_device_name(i)) for i in range(torch.cuda.device_count())]
    lines += [(package, _version(package)) for package in OPTIONAL_PACKAGES]
    path = config_file or str(default_config_path())
    lines.append(("Config file", path if os.path.isfile(path) else f"{path} (not found)"))
    return lines


def tracker_report() -> list[tuple[str, str]]:
    """(name, state) of every registered tracker, the names ``log_with`` and ``report_to`` accept.

    Example:
        >>> dict(tracker_report())["jsonl"]
        'available (lockstep.tracking.files.JSONLTracker)'
    """
    from lockstep.tracking.registry import registered_trackers

    lines = []
    for name, tracker_class in registered_trackers().items():
        parts = ["available" if tracker_class.is_available() else "not available"]
        parts += [f"{package} {_version(package)}" for package in tracker_class.requires_packages]
        if not tracker_class.is_available() and tracker_class.install_command:
            parts.append(tracker_class.install_command)
        lines.append((name, f"{', '.join(parts)} ({tracker_class.__module__}.{tracker_class.__qualname__})"))
    return lines


def backend_report() -> list[tuple[str, str]]:
    """(name, what it is and whether it can run here) of every registered backend, in the order they are
    asked whether they apply.

    Example:
        >>> dict(backend_report())["ddp"].split("; ")
        ["data parallel: torch's DistributedDataParallel, one replica per process", 'distributed_type MULTI_CPU/MULTI_GPU/MULTI_XPU/MULTI_MPS']
    """
    from lockstep.config.backend_specs import backend_specs

    lines = []
    for spec in backend_specs():
        parts = [spec.summary or spec.name]
        if spec.requirement:
            parts.append(f"{spec.requirement} {_version(spec.requirement)}")
        if spec.distributed_types:
            parts.append("distributed_type " + "/".join(t.value for t in spec.distributed_types))
        lines.append((spec.name, "; ".join(parts)))
    return lines


def layer_report() -> list[tuple[str, str]]:
    """(name, what it is and how it is asked for) of every registered layer (:mod:`lockstep.config.layer_specs`).

    Example:
        >>> dict(layer_report())["fault_tolerance"].split("; ")[-1]
        'Accelerator(fault_tolerance=...), --fault-tolerance, config section fault_tolerance_config'
    """
    from lockstep.config.layer_specs import layer_specs

    lines = []
    for spec in layer_specs():
        parts = [spec.summary or spec.name]
        if spec.requirement:
            parts.append(f"{spec.requirement} {_version(spec.requirement)}")
        asked = [
            *([f"Accelerator({spec.accelerator_argument}=...)"] if spec.accelerator_argument else []),
            *([f"--{spec.enable_flag.replace('_', '-')}"] if spec.enable_flag else []),
            *([f"config section {spec.config_section}"] if spec.config_section else []),
        ]
        if asked:
            parts.append(", ".join(asked))
        lines.append((spec.name, "; ".join(parts)))
    return lines


def cluster_report(environ: Mapping[str, str]) -> tuple[str, list[tuple[str, str]]]:
    """The cluster environment ``lockstep launch`` would read here: its title and (value, source) rows.

    Example:
        >>> cluster_report({"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-master-0"})[0]
        'Kubeflow PyTorchJob'
        >>> cluster_report({})
        ('none detected', [])
    """
    from lockstep.launcher.clusters import detect_cluster

    try:
        cluster = detect_cluster(environ)
    except UsageError as error:
        return "invalid", [("error", str(error))]
    if cluster is None:
        return "none detected", []
    return cluster.title, [(name, f"{value} ({source})") for name, value, source in cluster.rows()]


def _print_table(title: str, rows: list[tuple[str, str]]) -> None:
    print(f"\n{title}:")
    width = max(len(name) for name, _ in rows)
    for name, state in rows:
        print(f"  {name.ljust(width)} : {state}")


def run_env(args: argparse.Namespace) -> int:
    from lockstep.config.file import ConfigFileError, load_config_file

    lines = environment_report(args.config_file)
    width = max(len(name) for name, _ in lines)
    print("Copy-and-paste the text below in your bug report.\n")
    for name, value in lines:
        print(f"- {name.ljust(width)} : {value}")
    _print_table("Backends (asked in this order; the first that applies trains)", backend_report())
    _print_table(
        "Layers (run around every step of whichever backend trains)",
        layer_report() or [("none", "registered")],
    )
    _print_table("Trackers (log_with / report_to names)", tracker_report())
    title, rows = cluster_report(os.environ)
    print(f"\nCluster environment (what lockstep launch reads): {title}")
    if rows:
        _print_table("Derived for lockstep launch (value and where it came from)", rows)
    path = lines[-1][1]
    if os.path.isfile(path):
        try:
            config = load_config_file(path)
        except ConfigFileError as error:
            print(f"\nThe config file is invalid: {error}")
            return 0
        print("\nResolved config:")
        for key, value in config.to_dict().items():
            print(f"  {key}: {value}")
    return 0
