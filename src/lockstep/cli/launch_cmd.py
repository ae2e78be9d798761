"""``lockstep launch [flags] script.py [script args]``: run a script on any topology.

Flags take both spellings (``--num-processes`` and Accelerate's ``--num_processes``). Settings resolve as
flag > config file (``--config-file``, else the default file if it exists) > default. Processes are
started by torch's elastic agent (the engine behind torchrun), in this process.

Unlike ``accelerate launch --cpu --num_processes 2`` (which starts one process), on a CPU-only machine
``lockstep launch --num-processes 2`` starts two gloo processes that form one group.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from typing import Any

from lockstep.config.fsdp_keys import FSDP_KEYS
from lockstep.config.keys import SettingKey, flag_keys
from lockstep.config.plugins import DYNAMO_KEYS
from lockstep.errors import UsageError

Flag = tuple[tuple[str, ...], dict[str, Any]]
"""A flag's spellings and its argparse keyword arguments."""

FSDP_FLAGS: dict[str, SettingKey] = flag_keys(FSDP_KEYS)
"""The ``--fsdp-*`` flags by argparse ``dest`` (the ``fsdp_config`` key each one sets)."""


def table_flags(table: Iterable[SettingKey], *, label: str | None = None) -> list[Flag]:
    """The launch flags of a key table: each flag key's spellings, with its help (after ``label: ``)."""
    return [
        (entry.flag_spellings, {"dest": entry.key, "help": f"{label}: {entry.help}" if label else entry.help})
        for entry in flag_keys(table).values()
    ]


# Every flag defaults to "not given" so that config files apply.
LAUNCH_FLAGS: list[Flag] = [
    (
        ("--config-file", "--config_file"),
        {"dest": "config_file", "help": "YAML config (Accelerate's schema)"},
    ),
    (("--cpu",), {"dest": "use_cpu", "action": "store_true", "help": "train on the CPU even if GPUs exist"}),
    (
        ("--multi-gpu", "--multi_gpu"),
        {"dest": "multi_gpu", "action": "store_true", "help": "data parallel on GPUs"},
    ),
    (
        ("--num-processes", "--num_processes"),
        {"type": int, "help": "processes in the whole job (all machines)"},
    ),
    (("--num-machines", "--num_machines"), {"type": int, "help": "machines in the job"}),
    (
        ("--machine-rank", "--machine_rank"),
        {"type": int, "help": "rank of this machine (0 hosts the rendezvous)"},
    ),
    (("--main-process-ip", "--main_process_ip"), {"help": "address of machine 0"}),
    (("--main-process-port", "--main_process_port"), {"type": int, "help": "rendezvous port on machine 0"}),
    (("--rdzv-backend", "--rdzv_backend"), {"help": "static or c10d"}),
    (("--same-network", "--same_network"), {"action": "store_true", "help": "machines share a network"}),
    (
        ("--max-restarts", "--max_restarts"),
        {"type": int, "help": "restart all workers this often on failure"},
    ),
    (("--monitor-interval", "--monitor_interval"), {"type": float, "help": "seconds between health checks"}),
    (("--mixed-precision", "--mixed_precision"), {"help": "no, fp16 or bf16"}),
    (
        ("--gradient-accumulation-steps", "--gradient_accumulation_steps"),
        {"type": int, "help": "micro-batches per step"},
    ),
    *table_flags(DYNAMO_KEYS),
    (("--gpu-ids", "--gpu_ids"), {"help": "comma-separated GPU indices, or all"}),
    (("--debug",), {"action": "store_true", "help": "check collectives across ranks (LOCKSTEP_DEBUG)"}),
    (
        ("--use-fsdp", "--use_fsdp"),
        {"dest": "use_fsdp", "action": "store_true", "help": "shard the model with FSDP2"},
    ),
    *table_flags(FSDP_KEYS, label="FSDP"),
    (
        ("--use-deepspeed", "--use_deepspeed"),
        {"dest": "use_deepspeed", "action": "store_true", "help": "DeepSpeed (not yet)"},
    ),
]


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """The launch flags, shared by ``launch``, ``test`` and ``config explain``."""
    for spellings, kwargs in LAUNCH_FLAGS:
        parser.add_argument(*spellings, default=argparse.SUPPRESS, **kwargs)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("launch", help="run a training script on one or many processes/machines")
    add_launch_flags(parser)
    parser.add_argument("-m", "--module", action="store_true", help="run TARGET as a module (python -m)")
    parser.add_argument("target", metavar="script.py", help="the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(handler=run_launch)


def given_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The launch settings the user typed (flags they did not give are absent)."""
    internal = ("handler", "command", "target", "script_args", "module", "config_action")
    flags = {k: v for k, v in vars(args).items() if k not in internal}
    if flags.pop("use_deepspeed", False):
        if flags.get("use_fsdp"):
            raise UsageError("--use-fsdp and --use-deepspeed both shard the model and cannot be combined.")
        raise UsageError("--use-deepspeed is not supported yet: DeepSpeed is not part of this version.")
    fsdp_flags = {name: flags.pop(name) for name in list(flags) if name in FSDP_FLAGS}
    if fsdp_flags:
        flags["fsdp_config"] = {name: _fsdp_flag_value(name, value) for name, value in fsdp_flags.items()}
    if flags.pop("use_fsdp", False) or fsdp_flags:
        flags["distributed_type"] = "FSDP"
    if flags.pop("multi_gpu", False):
        flags["distributed_type"] = "MULTI_GPU"
    if flags.get("same_network") is False:
        flags.pop("same_network")
    return flags


def _fsdp_flag_value(name: str, value: str) -> Any:
    """A ``--fsdp-*`` flag's text, checked and normalized by its key's check (as in a config file)."""
    entry = FSDP_FLAGS[name]
    try:
        return entry.check(_typed(value), entry.flag_spellings[0])
    except ValueError as error:
        raise UsageError(str(error)) from None


def _typed(value: str) -> Any:
    """Flag text as YAML would read it: ``true``/``false`` as bools, digits as ints, the rest as text."""
    lowered = value.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    return int(value) if value.strip().isdigit() else value


def load_settings(args: argparse.Namespace) -> Any:
    """Resolve flags + config file into LaunchSettings (UsageError on bad input)."""
    from lockstep.config.file import ConfigFileError, default_config_path, load_config_file
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
    return resolve(flags, file_config, path)


def run_launch(args: argparse.Namespace) -> int:
    from lockstep.launcher.elastic import launch

    settings = load_settings(args)
    if not args.module and not os.path.isfile(args.target):
        raise UsageError(f"script {args.target!r} does not exist.")
    return launch(settings, args.target, list(args.script_args), module=args.module)
