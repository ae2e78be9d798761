"""Resolving launch settings: flag > cluster environment > config file > default, remembering where each
value came from.

The cluster environment (SLURM, Kubeflow, LSF, PBS, MPI: :mod:`lockstep.launcher.clusters`) gives the
machines, this machine's rank, machine 0's address and the port; a flag that contradicts the machine count
or rank it gives is an error naming both.

The result, :class:`LaunchSettings`, is what ``lockstep launch`` runs and what ``lockstep config explain``
prints. Its :meth:`~LaunchSettings.worker_settings` are serialized into one environment variable
(``LOCKSTEP_LAUNCH_CONFIG``) that the workers' process state reads in one place.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field, fields
from typing import Any

from lockstep.clusters import DetectedCluster
from lockstep.config.backend_specs import sectioned_specs, spec_for_distributed_type
from lockstep.config.enums import DistributedType, DynamoBackend, PrecisionType
from lockstep.config.plugins import dynamo_fields
from lockstep.config.topology import (
    check_device_agreement,
    checked_distributed_type,
    data_parallel_type,
    is_plain,
)
from lockstep.errors import UsageError
from lockstep.launcher.clusters.merge import apply_cluster

DEFAULT_SOURCE = "default"
FLAG_SOURCE = "flag"


def section_names() -> tuple[str, ...]:
    """The config file's sections that a launch reads (every registered backend's, layer's and setting
    group's, and ``dynamo_config``): flags override their keys one by one."""
    return (*(spec.config_section for spec in sectioned_specs() if spec.config_section), "dynamo_config")


def add_on_switches() -> dict[str, str]:
    """The switch of every add-on (layer, setting group) with one, by name (``use_parallelism_config``), with
    its section: the switch is on when the section is given (by the switch, a flag or the config file)."""
    return {
        spec.enable_flag: spec.config_section
        for spec in sectioned_specs()
        if spec.add_on and spec.enable_flag and spec.config_section
    }


GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd")
"""Present where an NVIDIA (or AMD ROCm) driver is loaded: without any, torch can see no CUDA device."""
_TEE = re.compile(r"^[0-3]$|^(\d+:[0-3],)*\d+:[0-3]$")
"""torchrun's ``--tee`` values: one stream code for every local rank, or ``rank:code`` pairs."""


@dataclass(kw_only=True)
class LaunchSettings:
    """Every setting of one launch, resolved."""

    num_processes: int
    """Processes in the whole job, across all machines (as in Accelerate); each machine runs
    ``num_processes / num_machines``."""
    num_machines: int = 1
    """Machines taking part in the job; the most, in an elastic job (``min_num_machines`` set)."""
    min_num_machines: int | None = None
    """The fewest machines an elastic job trains on (``--num-machines MIN:MAX``): torch's rendezvous admits
    between MIN and MAX machines, and a lost or joining machine restarts the workers on the new world size
    (``--max-restarts``). None: exactly ``num_machines``."""
    machine_rank: int = 0
    """Rank of this machine (0 hosts the rendezvous)."""
    main_process_ip: str = "127.0.0.1"
    """Address of machine 0."""
    main_process_port: int | None = None
    """Rendezvous port on machine 0 (a free port when unset on one machine; 29500 on several)."""
    cluster: str = "none"
    """The cluster environment the job's layout was read from (``--cluster``: ``auto`` detects it, ``none``
    reads none, a name reads only that one)."""
    cpus_per_machine: int | None = None
    """Cores this machine gives the job (from the scheduler, e.g. ``SLURM_CPUS_ON_NODE``); the workers'
    threads share them out. Unset: every core of the machine."""
    rdzv_backend: str = "static"
    """``static`` (fixed machine ranks) or ``c10d`` (torch's elastic rendezvous)."""
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    """More rendezvous options for torch's rendezvous handler (``--rdzv-conf join_timeout=900,...``)."""
    same_network: bool = True
    """The machines share a network (static rendezvous works)."""
    max_restarts: int = 0
    """Restart all workers this many times after a failure."""
    monitor_interval: float = 0.1
    """Seconds between checks of the workers' health."""
    role: str = "default"
    """Name of the workers' role: the elastic agent's ``ROLE_NAME`` and the prefix of ``--tee`` lines."""
    tee: str = "0"
    """Copy the workers' streams to files under ``log_dir`` and to the console: 0 none, 1 stdout, 2 stderr,
    3 both, or per local rank (``0:3,1:0``)."""
    log_dir: str | None = None
    """Folder of the workers' log files (``RUN/attempt_N/LOCAL_RANK/stdout.log``); a temporary one if unset."""
    quiet: bool = False
    """On failure, print only the line of the rank that failed first."""
    num_cpu_threads_per_process: int | None = None
    """``OMP_NUM_THREADS`` of each worker; unset: the environment's, else the cores shared out."""
    enable_cpu_affinity: bool = False
    """Pin each worker to its own equal share of this machine's cores (Linux)."""
    downcast_bf16: bool = False
    """A TPU setting of Accelerate (XLA_DOWNCAST_BF16); accepted, and without effect on CPUs and GPUs."""
    mixed_precision: str = "no"
    """``no``, ``fp16`` or ``bf16`` for the Accelerator."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step for the Accelerator."""
    dynamo_backend: str = "no"
    """``torch.compile`` backend for prepared models."""
    gpu_ids: str | None = None
    """Comma-separated GPU indices to use (``all`` or unset: every GPU)."""
    use_cpu: bool = False
    """Train on the CPU even when GPUs are present."""
    debug: bool = False
    """Check collectives across ranks (``LOCKSTEP_DEBUG``)."""
    distributed_type: str = DistributedType.NO.value
    """How processes share the work (derived from the topology)."""
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The config sections this launch was given (the config file's keys, overridden by the section's flags),
    by name; a section not given is absent. ``dynamo_config``: the ``torch.compile`` settings besides
    ``dynamo_backend`` (used when that is not ``no``); each registered backend's section (``fsdp_config``,
    ``deepspeed_config``: used when ``distributed_type`` chooses it); each layer's and setting group's
    (``fault_tolerance_config``; ``parallelism_config``: the mesh's sizes, unset sizes are 1 and all 1 is plain
    data parallelism): given, it is on. Each is also an attribute (``settings.fsdp_config``, empty when not
    given), and an add-on's switch too (``settings.use_parallelism_config``: whether its section is given)."""
    config_file: str | None = None
    """The config file that was read, if any."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each setting came from: ``flag``, ``config file``, ``default`` or ``derived``."""

    def __getattr__(self, name: str) -> Any:
        if name in section_names():
            return self.__dict__.get("sections", {}).get(name, {})
        switches = add_on_switches()
        if name in switches:
            return switches[name] in self.__dict__.get("sections", {})
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def world_size(self) -> int:
        return self.num_processes

    @property
    def processes_per_machine(self) -> int:
        return self.num_processes // self.num_machines

    @property
    def elastic(self) -> bool:
        """Whether the job trains on a varying number of machines (``--num-machines MIN:MAX``, MIN < MAX)."""
        return self.min_num_machines is not None and self.min_num_machines < self.num_machines

    def worker_settings(self) -> dict[str, Any]:
        """What the workers' Accelerator reads from ``LOCKSTEP_LAUNCH_CONFIG``."""
        return {
            "mixed_precision": self.mixed_precision,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "dynamo_backend": self.dynamo_backend,
            "dynamo_plugin": dynamo_fields(self.dynamo_config),
            "enable_cpu_affinity": self.enable_cpu_affinity,
            "use_cpu": self.use_cpu,
            "debug": self.debug,
            "distributed_type": self.distributed_type,
            **self.backend_sections(),
            "elastic": self.elastic,
        }

    def backend_sections(self) -> dict[str, dict[str, Any] | None]:
        """Every backend's config section: the chosen backend's as given, the others empty (the workers
        must not see settings of a backend that is not used); every add-on's as given, None when not given
        (given empty, it is on with its defaults)."""
        active = spec_for_distributed_type(self.distributed_type)
        sections: dict[str, dict[str, Any] | None] = {}
        for spec in sectioned_specs():
            if spec.config_section is None:
                continue
            given = self.sections.get(spec.config_section)
            if spec.add_on:
                sections[spec.config_section] = None if given is None else dict(given)
            else:
                sections[spec.config_section] = dict(given or {}) if spec is active else {}
        return sections

    def notes(self) -> list[str]:
        """Settings that were given and have no effect here, one line each (the CLI prints them as warnings)."""
        notes = []
        if self.downcast_bf16:
            notes.append(
                "downcast_bf16 is a TPU setting (XLA_DOWNCAST_BF16) and changes nothing on CPUs and GPUs: "
                "mixed_precision bf16 already computes in bf16 and keeps float32 weights."
            )
        active = spec_for_distributed_type(self.distributed_type)
        if active is not None and active.launcher_notes is not None and active.config_section is not None:
            notes.extend(active.launcher_notes(dict(getattr(self, active.config_section, None) or {})))
        if self.dynamo_backend == "no" and FLAG_SOURCE in self.sources.get("dynamo_config", ""):
            names = ", ".join(f"--{key.replace('_', '-')}" for key in self.dynamo_config)
            notes.append(
                f"{names} {'has' if len(self.dynamo_config) == 1 else 'have'} no effect without --dynamo-backend."
            )
        return notes

    def explain(self) -> list[tuple[str, Any, str]]:
        """(name, value, source) for every setting, in declaration order, then every section."""
        skip = {"sources", "config_file", "sections"}
        settings = [
            (f.name, getattr(self, f.name), self.sources.get(f.name, DEFAULT_SOURCE))
            for f in fields(self)
            if f.name not in skip
        ]
        switches = [
            (switch, getattr(self, switch), self.sources.get(section, DEFAULT_SOURCE))
            for switch, section in add_on_switches().items()
        ]
        sections = [
            (name, getattr(self, name), self.sources.get(name, DEFAULT_SOURCE)) for name in section_names()
        ]
        return settings + switches + sections


def _from_file(config: Any) -> dict[str, Any]:
    """The launch-relevant values a ClusterConfig sets (None/empty values are left out)."""
    if config is None:
        return {}
    dynamo = dict(getattr(config, "dynamo_config", None) or {})
    backend = dynamo.pop("dynamo_backend", None)
    values = {
        "num_processes": getattr(config, "num_processes", None),
        "num_machines": getattr(config, "num_machines", None),
        "min_num_machines": getattr(config, "min_num_machines", None),
        "machine_rank": getattr(config, "machine_rank", None),
        "main_process_ip": getattr(config, "main_process_ip", None),
        "main_process_port": getattr(config, "main_process_port", None),
        "rdzv_backend": getattr(config, "rdzv_backend", None),
        "same_network": getattr(config, "same_network", None),
        "mixed_precision": getattr(config, "mixed_precision", None),
        "gradient_accumulation_steps": getattr(config, "gradient_accumulation_steps", None),
        "dynamo_backend": backend,
        "dynamo_config": {k: v for k, v in dynamo.items() if v is not None} or None,
        "enable_cpu_affinity": getattr(config, "enable_cpu_affinity", None),
        "downcast_bf16": getattr(config, "downcast_bf16", None),
        "gpu_ids": getattr(config, "gpu_ids", None),
        "use_cpu": getattr(config, "use_cpu", None),
        "debug": getattr(config, "debug", None),
        "distributed_type": getattr(config, "distributed_type", None),
    }
    for section in section_names():
        if section != "dynamo_config":
            given = getattr(config, section, None) or {}
            values[section] = {k: v for k, v in given.items() if v is not None} or None
    if values["num_processes"] is not None and values["num_processes"] < 0:
        values["num_processes"] = None  # Accelerate writes -1 for "unset"
    if values["gpu_ids"] is not None:
        values["gpu_ids"] = str(values["gpu_ids"])
    return {k: v for k, v in values.items() if v is not None}


def _device_count() -> int:
    """CUDA (or ROCm) devices of this machine; 0 without importing torch where no GPU driver is loaded, so
    that a launch on a CPU machine (or one that fails validation) does not spend seconds importing torch."""
    if "torch" not in sys.modules and not any(os.path.exists(path) for path in GPU_DRIVER_PATHS):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve(
    flags: dict[str, Any],
    file_config: Any = None,
    file_path: str | None = None,
    *,
    cluster: DetectedCluster | None = None,
) -> LaunchSettings:
    """Merge explicit flags over the cluster environment over the config file over defaults, then validate.

    Args:
        flags: only the flags the user gave (name -> value).
        file_config: a loaded ``ClusterConfig``, or None.
        file_path: the file it came from (for messages and ``explain``).
        cluster: the cluster environment this machine runs in (``detect_cluster``), or None.

    Raises:
        UsageError: a bad setting, or a flag that contradicts the cluster environment.
    """
    from_file = _from_file(file_config)
    flags = _machine_range_split(flags)
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    sections = section_names()
    for name in {f.name for f in fields(LaunchSettings)} - {"sources", "config_file", "sections"} | {
        *sections
    }:
        if name in sections and name in flags and name in from_file:
            merged[name] = {**from_file[name], **flags[name]}
            sources[name] = f"config file {file_path} + flags"
        elif name in flags:
            merged[name], sources[name] = flags[name], FLAG_SOURCE
        elif name in from_file:
            merged[name], sources[name] = from_file[name], f"config file {file_path}"
    if cluster is not None:
        apply_cluster(merged, sources, flags, cluster)
        if "cluster" in flags:
            sources["cluster"] = FLAG_SOURCE
    elif "cluster" in merged:
        merged["cluster"] = "none"  # --cluster none, or auto with nothing detected
    _fill_topology_defaults(merged, sources)
    given = {name: merged.pop(name) for name in sections if name in merged}
    settings = LaunchSettings(**merged, sections=given, config_file=file_path, sources=sources)
    _validate(settings)
    return settings


def _fill_topology_defaults(merged: dict[str, Any], sources: dict[str, str]) -> None:
    if "num_processes" not in merged:
        gpus = 0 if merged.get("use_cpu") else _device_count()
        if gpus and merged.get("gpu_ids") not in (None, "all"):
            gpus = len(str(merged["gpu_ids"]).split(","))
        merged["num_processes"] = max(gpus, 1) * int(merged.get("num_machines", 1))
        sources["num_processes"] = "derived"
    if merged.get("num_machines", 1) > 1 and "main_process_port" not in merged:
        merged["main_process_port"] = 29500
    elastic = merged.get("min_num_machines") not in (None, merged.get("num_machines", 1))
    if (merged.get("same_network") is False or elastic) and "rdzv_backend" not in merged:
        merged["rdzv_backend"], sources["rdzv_backend"] = "c10d", "derived"
    requested = checked_distributed_type(merged.get("distributed_type"))
    world_size = int(merged["num_processes"])
    if world_size > 1 and is_plain(requested):
        cpu = bool(merged.get("use_cpu")) or _device_count() == 0
        merged["distributed_type"] = data_parallel_type(processes=world_size, cpu=cpu).value
        sources["distributed_type"] = "derived"
    elif requested is not None:
        merged["distributed_type"] = requested.value


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise UsageError(message)


def _validate(s: LaunchSettings) -> None:
    _validate_topology(s)
    _validate_workers(s)
    _check(
        s.gradient_accumulation_steps >= 1,
        f"--gradient-accumulation-steps {s.gradient_accumulation_steps} is invalid: it must be >= 1.",
    )
    for name, enum in (("mixed_precision", PrecisionType), ("dynamo_backend", DynamoBackend)):
        try:
            setattr(s, name, enum.parse(getattr(s, name), argument=f"--{name.replace('_', '-')}").value)
        except ValueError as error:
            raise UsageError(str(error)) from None
    _check(s.mixed_precision != "fp8", "--mixed-precision fp8 is not supported yet; use bf16 or fp16.")
    try:
        dynamo_fields(s.dynamo_config)
    except ValueError as error:
        raise UsageError(str(error)) from None
    check_device_agreement(s.distributed_type, use_cpu=s.use_cpu)
    _validate_backend_section(s)


def _validate_topology(s: LaunchSettings) -> None:
    """Process counts, machine ranks and the rendezvous."""
    _check(s.num_processes >= 1, f"--num-processes {s.num_processes} is invalid: it must be >= 1.")
    _check(s.num_machines >= 1, f"--num-machines {s.num_machines} is invalid: it must be >= 1.")
    _check(
        s.num_processes % s.num_machines == 0,
        f"--num-processes {s.num_processes} is invalid with --num-machines {s.num_machines}: it counts the "
        "processes of the whole job (as in Accelerate) and must be a multiple of the number of machines.",
    )
    if s.min_num_machines is not None:
        _validate_machine_range(s)
    _check(
        0 <= s.machine_rank < s.num_machines,
        f"--machine-rank {s.machine_rank} is invalid with --num-machines {s.num_machines}: "
        f"it must be between 0 and {s.num_machines - 1}.",
    )
    if s.main_process_port is not None:
        _check(
            0 < s.main_process_port < 65536,
            f"--main-process-port {s.main_process_port} is not a TCP port (1-65535).",
        )
    _check(
        s.rdzv_backend in ("static", "c10d"),
        f"--rdzv-backend {s.rdzv_backend!r} is invalid: use 'static' or 'c10d'.",
    )
    _check(s.max_restarts >= 0, f"--max-restarts {s.max_restarts} is invalid: it must be >= 0.")
    _check(
        s.monitor_interval > 0, f"--monitor-interval {s.monitor_interval} is invalid: it must be > 0 seconds."
    )


def _validate_workers(s: LaunchSettings) -> None:
    """What each worker gets: its role, logs, threads and cores."""
    _check(bool(s.role.strip()), f"--role {s.role!r} is invalid: give the workers' role a name.")
    _check(
        bool(_TEE.match(s.tee)),
        f"--tee {s.tee!r} is invalid: use 0 (none), 1 (stdout), 2 (stderr) or 3 (both), or per local rank, "
        "e.g. 0:3,1:0.",
    )
    if s.num_cpu_threads_per_process is not None:
        _check(
            s.num_cpu_threads_per_process >= 1,
            f"--num-cpu-threads-per-process {s.num_cpu_threads_per_process} is invalid: it must be >= 1.",
        )
    _check(
        not s.enable_cpu_affinity or hasattr(os, "sched_setaffinity"),
        "--enable-cpu-affinity needs os.sched_setaffinity, which this platform lacks (Linux has it); "
        "drop the flag.",
    )


def machine_count(text: str) -> int | tuple[int, int]:
    """``--num-machines`` text: ``N``, or ``MIN:MAX`` for an elastic job (torchrun's ``--nnodes`` spelling).

    Example:
        >>> machine_count("2"), machine_count("1:4")
        (2, (1, 4))

    Raises:
        UsageError: not a whole number or a MIN:MAX pair of them.
    """
    parts = [part.strip() for part in text.split(":")]
    _check(
        len(parts) in (1, 2) and all(part.isdigit() for part in parts),
        f"--num-machines {text!r} is invalid: give a number of machines (2) or, for an elastic job that "
        "trains on whoever is left, the fewest and the most (1:4).",
    )
    if len(parts) == 1:
        return int(parts[0])
    return int(parts[0]), int(parts[1])


def _machine_range_split(flags: dict[str, Any]) -> dict[str, Any]:
    """``--num-machines MIN:MAX`` as the two settings ``min_num_machines`` and ``num_machines``."""
    given = flags.get("num_machines")
    if not isinstance(given, tuple):
        return flags
    return {**flags, "min_num_machines": given[0], "num_machines": given[1]}


def _validate_machine_range(s: LaunchSettings) -> None:
    """An elastic job: 1 <= MIN <= MAX, on torch's c10d rendezvous (static ranks cannot change)."""
    given = f"--num-machines {s.min_num_machines}:{s.num_machines}"
    _check(s.min_num_machines >= 1, f"{given} is invalid: the fewest machines must be >= 1.")
    _check(
        s.min_num_machines <= s.num_machines,
        f"{given} is invalid: MIN ({s.min_num_machines}) is larger than MAX ({s.num_machines}). Write MIN:MAX.",
    )
    _check(
        not s.elastic or s.rdzv_backend == "c10d",
        f"{given} is an elastic job, which needs torch's c10d rendezvous, but --rdzv-backend is "
        f"{s.rdzv_backend!r} ({s.sources.get('rdzv_backend', DEFAULT_SOURCE)}). Drop --rdzv-backend or pass "
        "--rdzv-backend c10d.",
    )


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``--rdzv-conf`` text (``key1=value1,key2=value2``) as a dict, as torchrun reads it.

    Example:
        >>> parse_rdzv_conf("join_timeout=900, read_timeout=60")
        {'join_timeout': '900', 'read_timeout': '60'}

    Raises:
        UsageError: an option without a key or without a value.
    """
    options: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = (part.strip() for part in item.partition("="))
        _check(
            bool(key and value),
            f"--rdzv-conf {text!r} is invalid: {item!r} is not key=value. Write key1=value1,key2=value2.",
        )
        options[key] = value
    return options


def _validate_backend_section(s: LaunchSettings) -> None:
    """The chosen backend (and an add-on whose section is given) checks its section against the other
    settings (e.g. by building its plugin once; the N-D layout's sizes against the number of processes), so
    that a bad setting fails before any process starts."""
    active = spec_for_distributed_type(s.distributed_type)
    launch = {
        "mixed_precision": s.mixed_precision,
        "gradient_accumulation_steps": s.gradient_accumulation_steps,
        **{switch: getattr(s, switch) for switch in add_on_switches()},
        "num_processes": s.num_processes,
        "distributed_type": s.distributed_type,
        "num_machines": s.num_machines,
        "min_num_machines": s.min_num_machines,
        "main_process_port": s.main_process_port,
    }
    for spec in sectioned_specs():
        section = s.sections.get(spec.config_section or "")
        if spec.check_section is None or not (spec is active or (spec.add_on and section is not None)):
            continue
        try:
            spec.check_section(dict(section or {}), launch)
        except (TypeError, ValueError) as error:
            raise UsageError(str(error)) from None


def cpu_threads_per_process(local_processes: int, cpus: int | None = None) -> int:
    """``OMP_NUM_THREADS`` for each worker: the cores shared out (``cpus``, else every core of this machine),
    at least one."""
    return max(1, (cpus or os.cpu_count() or 1) // max(local_processes, 1))
