"""``lockstep env``: versions, devices, backends and the default config, for bug reports."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
from typing import Any

OPTIONAL_PACKAGES = (
    "numpy",
    "safetensors",
    "transformers",
    "deepspeed",
    "tensorboard",
    "mlflow",
    "wandb",
    "tqdm",
)


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
        return "not installed"


def environment_report(config_file: str | None = None) -> list[tuple[str, str]]:
    """(name, value) lines describing this machine and installation."""
    import torch
    import torch.distributed as dist

    import lockstep
    from lockstep.config.file import default_config_path

    lines = [
        ("lockstep", lockstep.__version__),
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


def run_env(args: argparse.Namespace) -> int:
    from lockstep.config.file import ConfigFileError, load_config_file

    lines = environment_report(args.config_file)
    width = max(len(name) for name, _ in lines)
    print("Copy-and-paste the text below in your bug report.\n")
    for name, value in lines:
        print(f"- {name.ljust(width)} : {value}")
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
