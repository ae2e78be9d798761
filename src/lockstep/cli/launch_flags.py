"""The launch flags shared by ``lockstep launch``, ``lockstep test`` and ``lockstep config explain``.

Every flag takes both spellings (``--num-processes`` and Accelerate's ``--num_processes``) and defaults to
"not given", so that the config file applies. Flags of a config section come from its key table: the
``--fsdp-*`` flags from ``FSDP_KEYS``, the DeepSpeed flags (``--zero-stage``, ``--deepspeed-config-file``,
...) from ``DEEPSPEED_KEYS``, the ``--parallelism-config-*`` flags from ``PARALLELISM_KEYS`` (each registered
spec's table, with its switch: ``--use-fsdp``, ``--use-parallelism-config``), the ``--dynamo-*`` flags from
``DYNAMO_KEYS``; the flags of features lockstep does not drive are refused
(:mod:`lockstep.cli._unsupported_flags`). :func:`given_flags` turns what was typed into the settings that
:func:`lockstep.launcher.settings.resolve` merges over the config file.

This module must not import torch.

Example:
    >>> parser = argparse.ArgumentParser()
    >>> add_launch_flags(parser)
    >>> given_flags(parser.parse_args(["--num_processes", "2", "--dynamo-mode", "MAX-AUTOTUNE", "--dynamo-use-dynamic"]))
    {'num_processes': 2, 'dynamo_config': {'dynamo_mode': 'max-autotune', 'dynamo_use_dynamic': True}}
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from typing import Any

from lockstep.cli._unsupported_flags import REFUSED_DEST, add_unsupported_flags, refused
from lockstep.config.backend_specs import sectioned_specs
from lockstep.config.keys import SettingKey, flag_keys
from lockstep.config.plugins import DYNAMO_KEYS
from lockstep.config.vocabulary import Vocabulary
from lockstep.errors import UsageError
from lockstep.launcher.settings import machine_count, parse_rdzv_conf

Flag = tuple[tuple[str, ...], dict[str, Any]]
"""A flag's spellings and its argparse keyword arguments."""

BACKEND_FLAGS: dict[str, dict[str, SettingKey]] = {
    spec.config_section: flag_keys(spec.keys) for spec in sectioned_specs() if spec.config_section
}
"""Each registered backend's, layer's and setting group's section flags (``--fsdp-*``, ``--zero-stage``,
``--parallelism-config-*`` ...) by argparse ``dest``."""
DYNAMO_FLAGS: dict[str, SettingKey] = {
    name: entry for name, entry in flag_keys(DYNAMO_KEYS).items() if entry.field != "backend"
}
"""The ``--dynamo-*`` flags that set the ``dynamo_config`` section (``--dynamo-backend`` is a setting of
its own, as in Accelerate)."""
SECTION_FLAGS: dict[str, Mapping[str, SettingKey]] = {
    **BACKEND_FLAGS,
    "dynamo_config": DYNAMO_FLAGS,
}
"""Each config section that flags set, with its flags by ``dest``."""
TARGET_FLAGS = ("module", "no_python", "main_training_function")
"""Flags of ``lockstep launch`` that say how to run the target, not how to launch (not settings)."""
_INTERNAL = ("handler", "command", "target", "script_args", "config_action", *TARGET_FLAGS)


def table_flags(table: Iterable[SettingKey], *, label: str | None = None) -> list[Flag]:
    """The launch flags of a key table: each flag key's spellings, with its help (after ``label: ``)."""
    return [
        (
            entry.flag_spellings,
            {
                "dest": entry.key,
                "help": f"{label}: {entry.help}" if label else entry.help,
                **({"action": "store_true"} if entry.switch else {}),
            },
        )
        for entry in flag_keys(table).values()
    ]


def _spellings(dest: str) -> tuple[str, ...]:
    return (f"--{dest.replace('_', '-')}", f"--{dest}")


def _backend_flags(spec: Vocabulary) -> list[Flag]:
    """A backend's (layer's, setting group's) launch switch (``--use-fsdp``) and the flags of its section's
    key table."""
    title = spec.title or spec.name
    flags = table_flags(spec.keys, label=title)
    if spec.enable_flag is None:
        return flags
    return [_switch(_spellings(spec.enable_flag), f"train with {spec.summary}", spec.enable_flag), *flags]


def _switch(spellings: tuple[str, ...], help: str, dest: str | None = None) -> Flag:
    return spellings, {"action": "store_true", "help": help, **({"dest": dest} if dest else {})}


LAUNCH_FLAGS: list[Flag] = [
    (
        ("--config-file", "--config_file"),
        {"dest": "config_file", "help": "YAML config (Accelerate's schema)"},
    ),
    _switch(("-q", "--quiet"), "on failure, print only the line of the rank that failed first", "quiet"),
    _switch(("--cpu",), "train on the CPU even if GPUs exist", "use_cpu"),
    _switch(("--multi-gpu", "--multi_gpu"), "data parallel on GPUs", "multi_gpu"),
    (
        ("--num-processes", "--num_processes"),
        {"type": int, "help": "processes in the whole job (all machines)"},
    ),
    (
        ("--num-machines", "--num_machines", "--nnodes"),
        {
            "dest": "num_machines",
            "help": "machines in the job: N, or MIN:MAX for an elastic job that trains on whoever is left",
        },
    ),
    (
        ("--num-cpu-threads-per-process", "--num_cpu_threads_per_process"),
        {"type": int, "help": "OMP_NUM_THREADS of each worker (default: the cores shared out)"},
    ),
    _switch(
        ("--enable-cpu-affinity", "--enable_cpu_affinity"),
        "pin each worker to its own equal share of this machine's cores (Linux)",
    ),
    (
        ("--machine-rank", "--machine_rank"),
        {"type": int, "help": "rank of this machine (0 hosts the rendezvous)"},
    ),
    (("--main-process-ip", "--main_process_ip"), {"help": "address of machine 0"}),
    (("--main-process-port", "--main_process_port"), {"type": int, "help": "rendezvous port on machine 0"}),
    (("--rdzv-backend", "--rdzv_backend"), {"help": "static or c10d"}),
    (
        ("--rdzv-conf", "--rdzv_conf"),
        {"help": "more rendezvous options: key1=value1,key2=value2 (e.g. join_timeout=900)"},
    ),
    _switch(("--same-network", "--same_network"), "machines share a network"),
    (
        ("--cluster",),
        {
            "metavar": "{auto,none,NAME}",
            "help": "read the job's machines, machine rank, address and port from the cluster's variables: "
            "auto (default) detects SLURM, Kubeflow, MPI, LSF, PBS or a registered environment; none reads none; "
            "a name (slurm, kubeflow, mpi, lsf, pbs, or a registered one's) reads only it",
        },
    ),
    (
        ("--max-restarts", "--max_restarts"),
        {"type": int, "help": "restart all workers this often on failure"},
    ),
    (("--monitor-interval", "--monitor_interval"), {"type": float, "help": "seconds between health checks"}),
    (("--role",), {"help": "name of the workers' role (ROLE_NAME; prefixes --tee lines)"}),
    (
        ("-t", "--tee"),
        {"help": "copy worker output to --log-dir files and the console: 0 none, 1 stdout, 2 stderr, 3 both"},
    ),
    (("--log-dir", "--log_dir"), {"help": "folder of the workers' log files (with --tee)"}),
    (("--mixed-precision", "--mixed_precision"), {"help": "no, fp16 or bf16"}),
    (
        ("--gradient-accumulation-steps", "--gradient_accumulation_steps"),
        {"type": int, "help": "micro-batches per step"},
    ),
    *table_flags(DYNAMO_KEYS),
    (("--gpu-ids", "--gpu_ids"), {"help": "comma-separated GPU indices, or all"}),
    _switch(("--debug",), "check collectives across ranks (LOCKSTEP_DEBUG)"),
    _switch(
        ("--downcast-bf16", "--downcast_bf16"),
        "a TPU setting of Accelerate: accepted, without effect on CPUs and GPUs",
    ),
    *(flag for spec in sectioned_specs() for flag in _backend_flags(spec)),
]
"""The launch flags, in ``--help`` order (unsupported flags are added hidden, after these)."""


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """The launch flags, shared by ``launch``, ``test`` and ``config explain``."""
    for spellings, kwargs in LAUNCH_FLAGS:
        parser.add_argument(*spellings, default=argparse.SUPPRESS, **kwargs)
    add_unsupported_flags(parser)


def given_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The launch settings the user typed (flags they did not give are absent).

    Raises:
        UsageError: an unsupported flag (the first one given), or a section flag's value that its key's
            check rejects.
    """
    unsupported = refused(args)
    if unsupported:
        flag, flags = unsupported[0]
        raise UsageError(flags.message(flag))
    flags = {k: v for k, v in vars(args).items() if k not in (*_INTERNAL, REFUSED_DEST)}
    for section, keys in SECTION_FLAGS.items():
        given = {name: flags.pop(name) for name in list(flags) if name in keys}
        if given:
            flags[section] = {name: _section_flag_value(keys[name], value) for name, value in given.items()}
    _choose_backend(flags)
    if flags.pop("multi_gpu", False):
        flags["distributed_type"] = "MULTI_GPU"
    if "rdzv_conf" in flags:
        flags["rdzv_conf"] = parse_rdzv_conf(flags["rdzv_conf"])
    if "num_machines" in flags:
        flags["num_machines"] = machine_count(str(flags["num_machines"]))
    return flags


def _choose_backend(flags: dict[str, Any]) -> None:
    """The backend whose switch (``--use-fsdp``) or section flags were given becomes the distributed type;
    two of them are an error. An add-on's switch (``--fault-tolerance``, ``--use-parallelism-config``) gives
    its section, empty unless its flags fill it."""
    for spec in sectioned_specs():  # an add-on (fault tolerance, the layout) goes beside the chosen backend
        if spec.add_on and spec.enable_flag and flags.pop(spec.enable_flag, False):
            flags.setdefault(spec.config_section, {})
    chosen = [
        spec
        for spec in sectioned_specs()
        if not spec.add_on
        and (
            (flags.pop(spec.enable_flag, False) if spec.enable_flag else False)
            or spec.config_section in flags
        )
    ]
    if len(chosen) > 1:
        given = " and ".join(
            f"{_spellings(spec.enable_flag or spec.name)[0]} (or a {spec.title or spec.name} flag)"
            for spec in chosen
        )
        raise UsageError(
            f"{given} both choose how the model is distributed and cannot be combined: keep one of them."
        )
    if chosen and chosen[0].distributed_types:
        flags["distributed_type"] = chosen[0].distributed_types[0].value


def _section_flag_value(entry: SettingKey, value: Any) -> Any:
    """A section flag's text, checked and normalized by its key's check (as in a config file)."""
    try:
        return entry.check(_typed(value) if isinstance(value, str) else value, entry.flag_spellings[0])
    except ValueError as error:
        raise UsageError(str(error)) from None


def _typed(value: str) -> Any:
    """Flag text as YAML would read it: ``true``/``false`` as bools, digits as ints, the rest as text."""
    lowered = value.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    return int(value) if value.strip().isdigit() else value
