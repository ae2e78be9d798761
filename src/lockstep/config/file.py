"""The launch config file: Accelerate's ``default_config.yaml``, read and written by lockstep.

A file written by ``accelerate config`` loads unchanged. Keys that configure hardware or services lockstep
does not drive (TPU pods, SageMaker, IPEX) are ignored with one warning; unknown keys and wrong values are
:class:`ConfigFileError` naming the file and the key path. The default file lives in
``$LOCKSTEP_HOME``, else ``$XDG_CACHE_HOME/lockstep``, else ``~/.cache/lockstep``.

This module must not import torch: ``lockstep config`` and ``lockstep launch`` read it at start-up.

Example:
    >>> config = ClusterConfig(distributed_type="MULTI_CPU", num_processes=2)
    >>> save_config_file(config, "/tmp/lockstep-doc/cfg.yaml")
    PosixPath('/tmp/lockstep-doc/cfg.yaml')
    >>> load_config_file("/tmp/lockstep-doc/cfg.yaml") == config
    True
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from lockstep import _env
from lockstep.config import checks
from lockstep.config.backend_specs import sectioned_specs
from lockstep.config.enums import DistributedType, PrecisionType
from lockstep.config.keys import Check, SettingKey, file_keys
from lockstep.config.plugins import DYNAMO_KEYS
from lockstep.config.setting_specs import setting_specs
from lockstep.errors import ConfigFileError

CONFIG_FILE_NAME = "default_config.yaml"


ConfigKey = SettingKey
"""One key of a config section (the name before :class:`~lockstep.config.keys.SettingKey`)."""

# --- the sections, derived from the key table next to each dataclass ---------------------------------

DYNAMO_CONFIG_KEYS: dict[str, SettingKey] = file_keys(DYNAMO_KEYS)
"""``dynamo_config`` keys, from :data:`lockstep.config.plugins.DYNAMO_KEYS`."""
KEPT_SECTIONS = ("megatron_lm_config", "tp_config", "fp8_config", "mpirun_config")
"""Accelerate's sections for features lockstep does not drive: accepted and kept as written."""

# Accelerate keys for hardware and services lockstep does not drive: accepted, warned about, ignored.
IGNORED_KEYS = frozenset(
    {"tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "tpu_vm", "tpu_env", "command_file"}
    | {"commands", "ipex_config", "ec2_instance_type", "iam_role_name", "image_uri", "profile", "region"}
    | {"base_job_name", "pytorch_version", "transformers_version", "py_version", "additional_args"}
)
_IGNORED_PREFIXES = ("sagemaker_",)

_SETTING_CHECKS: dict[str, Check] = {
    "compute_environment": checks.compute_environment,
    "distributed_type": checks.enum_value(DistributedType),
    "mixed_precision": checks.enum_value(PrecisionType),
    "use_cpu": checks.boolean,
    "debug": checks.boolean,
    "num_processes": checks.optional(checks.num_processes),
    "num_machines": checks.int_range(1),
    "min_num_machines": checks.optional(checks.int_range(1)),
    "machine_rank": checks.int_range(0),
    "gpu_ids": checks.optional(checks.gpu_ids),
    "main_process_ip": checks.optional(checks.string),
    "main_process_port": checks.optional(checks.int_range(1, 65535)),
    "rdzv_backend": checks.choice("static", "c10d", "etcd", "etcd-v2"),
    "same_network": checks.boolean,
    "main_training_function": checks.string,
    "enable_cpu_affinity": checks.boolean,
    "downcast_bf16": checks.boolean,
    "gradient_accumulation_steps": checks.optional(checks.int_range(1)),
}
"""Every top-level key of the file that is a single setting -> its check (the fields of
:class:`ClusterConfig`)."""


def section_keys() -> dict[str, dict[str, SettingKey]]:
    """Every section of the file that has a key table, with its keys: ``dynamo_config``, and each registered
    backend's, layer's and setting group's section (``fsdp_config``, ``deepspeed_config``, ...,
    ``parallelism_config``: from the key table its spec names, :mod:`lockstep.config.backend_specs`).

    Example:
        >>> sorted(section_keys())[:3]
        ['deepspeed_config', 'dynamo_config', 'fault_tolerance_config']
    """
    return {
        "dynamo_config": DYNAMO_CONFIG_KEYS,
        **{spec.config_section: file_keys(spec.keys) for spec in sectioned_specs() if spec.config_section},
    }


def section_checks() -> dict[str, Check]:
    """Every section of the file -> its check: those of :func:`section_keys`, and the sections kept as written."""
    return {
        **{name: checks.section(keys) for name, keys in section_keys().items()},
        **dict.fromkeys(KEPT_SECTIONS, checks.open_section),
    }


def _check_consistency(values: Mapping[str, Any]) -> None:
    machines, rank, processes = values["num_machines"], values["machine_rank"], values["num_processes"]
    if rank >= machines:
        raise ValueError(f"machine_rank must be < num_machines ({machines}), got {rank}")
    fewest = values["min_num_machines"]
    if fewest is not None and fewest > machines:
        raise ValueError(
            f"min_num_machines ({fewest}) must be <= num_machines ({machines}): the job trains on between "
            "min_num_machines and num_machines machines"
        )
    if processes is not None and processes % machines:
        raise ValueError(
            f"num_processes ({processes}) must be a multiple of num_machines ({machines}): it counts the "
            "processes of all machines together"
        )
    if values["distributed_type"] == DistributedType.NO and processes not in (None, 1):
        raise ValueError(
            f"distributed_type NO runs one process, but num_processes is {processes}; "
            "use MULTI_CPU or MULTI_GPU for more"
        )


def _validated(values: Mapping[str, Any], sections: Mapping[str, Any], source: str) -> tuple[dict, dict]:
    """Check and normalize every setting and every section (an absent one is empty); errors become
    ConfigFileError prefixed with ``source``."""
    try:
        settings = {name: check(values[name], name) for name, check in _SETTING_CHECKS.items()}
        found = {name: check(sections.get(name) or {}, name) for name, check in section_checks().items()}
        _check_consistency(settings)
    except ValueError as error:
        raise ConfigFileError(f"{source}: {error}") from None
    return settings, found


# --- the file -----------------------------------------------------------------------------------------


@dataclass(kw_only=True, init=False)
class ClusterConfig:
    """The settings of ``default_config.yaml``, with Accelerate's key names and defaults.

    Unset values are ``None`` (``num_processes``, ``gpu_ids``, ``main_process_ip``, ``main_process_port``,
    ``gradient_accumulation_steps``): the launcher decides them. Sections are plain dicts of YAML values
    (empty when absent) in :attr:`sections`, each checked against its key table (:func:`section_keys`).

    Example:
        >>> ClusterConfig(distributed_type="MULTI_GPU", num_processes=-1, mixed_precision="bf16").num_processes
        >>> ClusterConfig.from_dict({"num_processes": "two"})
        Traceback (most recent call last):
        lockstep.errors.ConfigFileError: <dict>: num_processes must be an integer, got 'two'
    """

    compute_environment: str = "LOCAL_MACHINE"
    """Where the job runs; lockstep supports only LOCAL_MACHINE (machines you reach yourself)."""
    distributed_type: DistributedType = DistributedType.NO
    """How the processes share the work: NO, MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED, ..."""
    mixed_precision: PrecisionType = PrecisionType.NO
    """Mixed precision: no, fp16, bf16 or fp8."""
    use_cpu: bool = False
    """Train on the CPU even when a GPU is present."""
    debug: bool = False
    """Check collectives across ranks (shapes) before running them; slower, but reports instead of hanging."""
    num_processes: int | None = None
    """Processes of all machines together; None (Accelerate's -1) lets the launcher decide."""
    num_machines: int = 1
    """Machines (nodes) in the job; the most, when ``min_num_machines`` is set."""
    min_num_machines: int | None = None
    """lockstep extension: the fewest machines the job trains on (an elastic job, ``--num-machines MIN:MAX``:
    it keeps training on whoever is left after a machine is lost, and takes machines that join); None: exactly
    ``num_machines``."""
    machine_rank: int = 0
    """Rank of this machine, from 0 to num_machines - 1."""
    gpu_ids: str | None = None
    """GPUs of this machine to use: 'all' or numbers such as '0,1'; None means all."""
    main_process_ip: str | None = None
    """Address of machine 0 (the rendezvous host) in a multi-machine job."""
    main_process_port: int | None = None
    """Port of the rendezvous on machine 0; None means the launcher's default (29500)."""
    rdzv_backend: str = "static"
    """Rendezvous backend of torchrun: static, c10d, etcd or etcd-v2."""
    same_network: bool = True
    """Whether all machines share a local network."""
    main_training_function: str = "main"
    """Name of the function a notebook launcher starts in every process."""
    enable_cpu_affinity: bool = False
    """Pin each process to the CPU cores near its GPU (NUMA)."""
    downcast_bf16: bool = False
    """Store fp32 tensors as bf16 (a TPU setting in Accelerate; accepted for compatibility)."""
    gradient_accumulation_steps: int | None = None
    """lockstep extension: micro-batches per optimizer step; None leaves it to the script."""
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Every section of the file by name, each a dict of YAML values (empty when absent): ``dynamo_config``
    (torch.compile), each registered backend's, layer's and setting group's (``fsdp_config``,
    ``deepspeed_config``, ``fault_tolerance_config``, ``parallelism_config`` (N-D sizes: a non-empty section
    makes the workers build a ParallelismConfig), ...), and Accelerate's sections lockstep keeps as written
    (``megatron_lm_config``, ``tp_config``, ``fp8_config``, ``mpirun_config``). Each is also an attribute
    (``config.fsdp_config``) and a keyword (``ClusterConfig(fsdp_config={...})``), as in Accelerate."""

    def __init__(self, *, sections: Mapping[str, Any] | None = None, **values: Any) -> None:
        known = section_checks()
        given = dict(sections or {})
        for name in list(values):
            if name in known:
                given[name] = values.pop(name)
        unknown = sorted(set(values) - set(_SETTING_CHECKS))
        if unknown:
            raise TypeError(f"ClusterConfig() got an unexpected keyword argument {unknown[0]!r}")
        self._set(values, given, source="ClusterConfig")

    def _set(self, values: Mapping[str, Any], sections: Mapping[str, Any], *, source: str) -> None:
        defaults = {item.name: _default(item) for item in fields(self) if item.name != "sections"}
        settings, self.sections = _validated({**defaults, **values}, sections, source)
        for name, value in settings.items():
            setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:
        sections = self.__dict__.get("sections")
        if sections is not None and name in sections:
            return sections[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<dict>") -> ClusterConfig:
        """Build from the mapping of a config file; ``source`` names the file in error messages."""
        if not isinstance(data, Mapping):
            raise ConfigFileError(
                f"{source}: the file must hold a mapping of settings (key: value lines), "
                f"got {type(data).__name__}"
            )
        try:
            data = _upgrade_legacy_keys(data)
            # Before the key checks: a SageMaker file has many keys we do not know.
            if data.get("compute_environment") is not None:
                checks.compute_environment(data["compute_environment"], "compute_environment")
        except ValueError as error:
            raise ConfigFileError(f"{source}: {error}") from None
        known = section_checks()
        _reject_unknown_keys(data, known, source)
        _warn_ignored_keys(data, source)
        given = {name: value for name, value in data.items() if value is not None}
        config = cls.__new__(cls)
        config._set(
            {name: value for name, value in given.items() if name in _SETTING_CHECKS},
            {name: value for name, value in given.items() if name in known},
            source=source,
        )
        return config

    def to_dict(self) -> dict[str, Any]:
        """The mapping written to the file: Accelerate's keys, plain values, no unset values or empty sections."""
        result: dict[str, Any] = {}
        for item in fields(self):
            if item.name == "sections":
                continue
            value = getattr(self, item.name)
            if isinstance(value, DistributedType | PrecisionType):
                value = value.value
            if value is not None:
                result[item.name] = value
        result.update({name: dict(section) for name, section in self.sections.items() if section})
        return result

    def summary(self) -> str:
        """One line for people, e.g. ``MULTI_GPU, 2 processes on 1 machine, mixed precision fp16``."""
        processes = (
            "launcher decides the processes"
            if self.num_processes is None
            else (f"{self.num_processes} process{'es' if self.num_processes != 1 else ''}")
        )
        machines = f"{self.num_machines} machine{'s' if self.num_machines != 1 else ''}"
        parts = [f"{self.distributed_type.value}, {processes} on {machines}"]
        parts.append(f"mixed precision {self.mixed_precision.value}")
        if self.use_cpu:
            parts.append("CPU only")
        if self.gradient_accumulation_steps is not None:
            parts.append(f"gradient accumulation {self.gradient_accumulation_steps}")
        for spec in setting_specs():
            described = spec.describe(self.sections.get(spec.config_section or "") or {})
            parts.extend([described] if described else [])
        backend = self.dynamo_config.get("dynamo_backend")
        if backend not in (None, "NO"):
            parts.append(f"torch.compile {str(backend).lower()}")
        return ", ".join(parts)


def _default(item: Field[Any]) -> Any:
    if item.default_factory is not MISSING:
        return item.default_factory()
    return item.default


def _upgrade_legacy_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    """Old Accelerate files: ``fp16: true`` and a top-level ``dynamo_backend`` (as Accelerate converts them)."""
    data = dict(data)
    if "fp16" in data:
        fp16 = data.pop("fp16")
        if "mixed_precision" not in data and fp16 is not None and checks.boolean(fp16, "fp16"):
            data["mixed_precision"] = "fp16"
    if "dynamo_backend" in data:
        backend = data.pop("dynamo_backend")
        dynamo = dict(data.get("dynamo_config") or {})
        if str(backend).upper() != "NO":
            dynamo.setdefault("dynamo_backend", backend)
        data["dynamo_config"] = dynamo
    return data


def _is_ignored(key: Any) -> bool:
    return key in IGNORED_KEYS or (isinstance(key, str) and key.startswith(_IGNORED_PREFIXES))


def _reject_unknown_keys(data: Mapping[str, Any], sections: Mapping[str, Any], source: str) -> None:
    known = {*_SETTING_CHECKS, *sections}
    unknown = [key for key in data if key not in known and not _is_ignored(key)]
    if unknown:
        raise ConfigFileError(
            f"{source}: {unknown[0]} is not a known key (known: {', '.join(sorted(known))})"
        )


def _warn_ignored_keys(data: Mapping[str, Any], source: str) -> None:
    ignored = sorted(str(key) for key in data if _is_ignored(key))
    if ignored:
        warnings.warn(
            f"{source}: ignoring {', '.join(ignored)}: these configure TPU pods, SageMaker or IPEX, "
            "which lockstep does not drive.",
            UserWarning,
            stacklevel=4,
        )


def default_config_path() -> Path:
    """Where ``lockstep config`` writes and ``lockstep launch`` reads the default file.

    ``$LOCKSTEP_HOME/default_config.yaml``, else ``$XDG_CACHE_HOME/lockstep/...``, else
    ``~/.cache/lockstep/...``.
    """
    return Path(_env.config_home()) / CONFIG_FILE_NAME


def load_config_file(path: str | os.PathLike[str]) -> ClusterConfig:
    """Read and check a config file (YAML, or JSON as older Accelerate wrote).

    Raises:
        ConfigFileError: the file is missing, unreadable, not YAML, not a mapping, or holds an unknown key
            or a bad value; the message names the file and the key path.

    Example:
        >>> load_config_file(default_config_path())  # doctest: +SKIP
        ClusterConfig(compute_environment='LOCAL_MACHINE', distributed_type=<DistributedType.MULTI_GPU: ...>, ...)
    """
    import yaml  # only here: PyYAML takes a moment to import

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigFileError(f"{path}: no such config file. Run `lockstep config` to write one.") from None
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "it is not UTF-8 text"
        raise ConfigFileError(f"{path}: cannot read the config file ({reason}).") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        problem = getattr(error, "problem", None) or "bad syntax"
        raise ConfigFileError(f"{path}: invalid YAML{line}: {problem}.") from None
    return ClusterConfig.from_dict(data, source=str(path))


def save_config_file(config: ClusterConfig, path: str | os.PathLike[str]) -> Path:
    """Write ``config`` with Accelerate's key names, creating folders; returns the path.

    The file is YAML, or JSON when ``path`` ends in ``.json`` (as Accelerate writes both). The write is
    atomic (a temporary file renamed over the target), so a crash never leaves half a file.
    """
    return write_settings(config.to_dict(), path)


def write_settings(data: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write a mapping of settings as YAML (JSON for a ``.json`` path), atomically; returns the path."""
    import json

    import yaml

    path = Path(path)
    if path.suffix.lower() == ".json":
        text = json.dumps(dict(data), indent=2, sort_keys=True) + "\n"
    else:
        text = yaml.safe_dump(dict(data), sort_keys=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path
