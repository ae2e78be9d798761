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
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

from lockstep import _env
from lockstep.config.enums import DistributedType, DynamoBackend, PrecisionType
from lockstep.errors import ConfigFileError

CONFIG_FILE_NAME = "default_config.yaml"


Check = Callable[[Any, str], Any]
"""Turns a raw YAML value at a key path into its normalized form, or raises ValueError naming the path."""


class ConfigKey(NamedTuple):
    """One key of a config section: how its value is checked, and its help text."""

    check: Check
    help: str


# --- value checks: each takes (value, key path) and returns the normalized value ----------------------

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def _bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{key} must be true or false, got {value!r}")


def _int(value: Any, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    number: float | None = None
    if isinstance(value, float):
        number = value
    elif isinstance(value, str):
        try:
            number = float(value.strip())  # also takes '1e8', which YAML 1.1 leaves as a string
        except ValueError:
            number = None
    if number is not None and number.is_integer():
        return int(number)
    raise ValueError(f"{key} must be an integer, got {value!r}")


def _str(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{key} must be a non-empty string, got {value!r}")
    return value.strip()


def _int_range(low: int, high: int | None = None) -> Check:
    def check(value: Any, key: str) -> int:
        number = _int(value, key)
        if number < low or (high is not None and number > high):
            bounds = f">= {low}" if high is None else f"between {low} and {high}"
            raise ValueError(f"{key} must be {bounds}, got {number}")
        return number

    return check


def _choice(*choices: str) -> Check:
    def check(value: Any, key: str) -> str:
        for choice in choices:
            if str(value).strip().lower() == choice.lower():
                return choice
        raise ValueError(f"{key} must be one of {', '.join(choices)}, got {value!r}")

    return check


def _auto_or(check: Check) -> Check:
    def auto_or(value: Any, key: str) -> Any:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        return check(value, key)

    return auto_or


def _non_negative_float(value: Any, key: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = -1.0
    if isinstance(value, bool) or not number >= 0:
        raise ValueError(f"{key} must be a number >= 0, got {value!r}")
    return number


def _class_names(value: Any, key: str) -> str | list[str]:
    if isinstance(value, list) and value and all(isinstance(item, str) and item for item in value):
        return list(value)
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise ValueError(f"{key} must be class names, comma-separated or as a list, got {value!r}")


_SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")


def _sharding_strategy(value: Any, key: str) -> str:
    # Accelerate < 0.20 wrote the strategy as its 1-based number.
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= len(_SHARDING_STRATEGIES):
        return _SHARDING_STRATEGIES[value - 1]
    return _choice(*_SHARDING_STRATEGIES)(value, key)


def _reshard_after_forward(value: Any, key: str) -> bool | str:
    # FSDP2 takes a bool; Accelerate writes the FSDP1 sharding strategy under the same key.
    try:
        return _bool(value, key)
    except ValueError:
        pass
    try:
        return _choice(*_SHARDING_STRATEGIES)(value, key)
    except ValueError:
        raise ValueError(
            f"{key} must be true or false (FSDP2) or one of {', '.join(_SHARDING_STRATEGIES)} (FSDP1), "
            f"got {value!r}"
        ) from None


def _dynamo_backend(value: Any, key: str) -> str:
    try:
        return DynamoBackend.parse(value, argument=key).name  # Accelerate writes the upper-case name
    except ValueError:
        choices = ", ".join(member.value for member in DynamoBackend)
        raise ValueError(f"{key} must be one of {choices}, got {value!r}") from None


def _section(schema: Mapping[str, ConfigKey]) -> Check:
    def check(value: Any, key: str) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise ValueError(f"{key} must be a mapping of settings, got {value!r}")
        result: dict[str, Any] = {}
        for name, item in value.items():
            if name not in schema:
                raise ValueError(f"{key}.{name} is not a known key (known: {', '.join(sorted(schema))})")
            result[name] = None if item is None else schema[name].check(item, f"{key}.{name}")
        return result

    return check


def _open_section(value: Any, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(name, str) for name in value):
        raise ValueError(f"{key} must be a mapping of settings, got {value!r}")
    return dict(value)


# --- the sections Accelerate writes --------------------------------------------------------------------

DYNAMO_CONFIG_KEYS: dict[str, ConfigKey] = {
    "dynamo_backend": ConfigKey(_dynamo_backend, "torch.compile backend, e.g. INDUCTOR; NO turns it off."),
    "dynamo_mode": ConfigKey(
        _choice("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
        "torch.compile mode.",
    ),
    "dynamo_use_fullgraph": ConfigKey(_bool, "Compile the whole model as one graph (error on graph breaks)."),
    "dynamo_use_dynamic": ConfigKey(_bool, "Trace with dynamic shapes."),
    "dynamo_use_regional_compilation": ConfigKey(_bool, "Compile each repeated block once and reuse it."),
}

FSDP_CONFIG_KEYS: dict[str, ConfigKey] = {
    "fsdp_version": ConfigKey(
        _int_range(1, 2), "1: FullyShardedDataParallel; 2: fully_shard (per-parameter)."
    ),
    "fsdp_reshard_after_forward": ConfigKey(
        _reshard_after_forward, "FSDP2: free gathered parameters after forward; FSDP1: the sharding strategy."
    ),
    "fsdp_cpu_offload": ConfigKey(_bool, "Keep parameters and gradients on the CPU between uses."),
    "fsdp_offload_params": ConfigKey(_bool, "Keep parameters and gradients on the CPU between uses."),
    "fsdp_auto_wrap_policy": ConfigKey(
        _choice("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"), "Which submodules become FSDP units."
    ),
    "fsdp_transformer_layer_cls_to_wrap": ConfigKey(
        _class_names, "Layer classes to wrap with TRANSFORMER_BASED_WRAP, e.g. LlamaDecoderLayer."
    ),
    "fsdp_min_num_params": ConfigKey(
        _int_range(0), "Smallest module (in parameters) that SIZE_BASED_WRAP wraps."
    ),
    "fsdp_cpu_ram_efficient_loading": ConfigKey(_bool, "Load weights on rank 0 only, then broadcast."),
    "fsdp_activation_checkpointing": ConfigKey(_bool, "Recompute activations of wrapped layers in backward."),
    "fsdp_state_dict_type": ConfigKey(
        _choice("SHARDED_STATE_DICT", "FULL_STATE_DICT", "LOCAL_STATE_DICT"),
        "How checkpoints store the model.",
    ),
    "fsdp_sharding_strategy": ConfigKey(_sharding_strategy, "FSDP1 sharding strategy, e.g. FULL_SHARD."),
    "fsdp_backward_prefetch": ConfigKey(
        _choice("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"),
        "FSDP1: when to gather the next unit in backward.",
    ),
    "fsdp_backward_prefetch_policy": ConfigKey(
        _choice("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"), "Old name of fsdp_backward_prefetch."
    ),
    "fsdp_forward_prefetch": ConfigKey(_bool, "FSDP1: gather the next unit during forward."),
    "fsdp_sync_module_states": ConfigKey(_bool, "FSDP1: broadcast rank 0's weights when wrapping."),
    "fsdp_use_orig_params": ConfigKey(_bool, "FSDP1: keep the original parameters visible to the optimizer."),
}

DEEPSPEED_CONFIG_KEYS: dict[str, ConfigKey] = {
    "deepspeed_config_file": ConfigKey(_str, "Path of a DeepSpeed JSON config; replaces the keys below."),
    "zero_stage": ConfigKey(
        _int_range(0, 3), "ZeRO stage: 0 off, 1 optimizer, 2 + gradients, 3 + parameters."
    ),
    "gradient_accumulation_steps": ConfigKey(_auto_or(_int_range(1)), "Micro-batches per optimizer step."),
    "gradient_clipping": ConfigKey(_auto_or(_non_negative_float), "Clip the global gradient norm to this."),
    "offload_optimizer_device": ConfigKey(_choice("none", "cpu", "nvme"), "Where optimizer states live."),
    "offload_param_device": ConfigKey(_choice("none", "cpu", "nvme"), "Where parameters live (ZeRO-3)."),
    "offload_optimizer_nvme_path": ConfigKey(_str, "NVMe folder for offloaded optimizer states."),
    "offload_param_nvme_path": ConfigKey(_str, "NVMe folder for offloaded parameters."),
    "zero3_init_flag": ConfigKey(_bool, "Build the model already sharded (deepspeed.zero.Init)."),
    "zero3_save_16bit_model": ConfigKey(_bool, "ZeRO-3: also save the gathered 16-bit weights."),
    "deepspeed_multinode_launcher": ConfigKey(
        _choice("pdsh", "standard", "openmpi", "mvapich", "mpich", "nossh"),
        "How DeepSpeed starts other machines.",
    ),
    "deepspeed_hostfile": ConfigKey(_str, "Hostfile listing machines and their slots."),
    "deepspeed_exclusion_filter": ConfigKey(_str, "Hosts or devices to leave out."),
    "deepspeed_inclusion_filter": ConfigKey(_str, "Hosts or devices to use."),
    "deepspeed_moe_layer_cls_names": ConfigKey(_str, "Comma-separated mixture-of-experts layer classes."),
}

# Accelerate keys for hardware and services lockstep does not drive: accepted, warned about, ignored.
IGNORED_KEYS = frozenset(
    {"tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "tpu_vm", "tpu_env", "command_file"}
    | {"commands", "ipex_config", "ec2_instance_type", "iam_role_name", "image_uri", "profile", "region"}
    | {"base_job_name", "pytorch_version", "transformers_version", "py_version", "additional_args"}
)
_IGNORED_PREFIXES = ("sagemaker_",)


# --- top-level checks ---------------------------------------------------------------------------------


def _compute_environment(value: Any, key: str) -> str:
    if str(value).strip().upper() == "AMAZON_SAGEMAKER":
        raise ValueError(
            f"{key} AMAZON_SAGEMAKER is not supported: lockstep launches on machines you reach yourself. "
            "Set it to LOCAL_MACHINE (or run `lockstep config`) and start the job with `lockstep launch`"
        )
    return _choice("LOCAL_MACHINE")(value, key)


def _enum(enum: type[DistributedType] | type[PrecisionType]) -> Check:
    def check(value: Any, key: str) -> Any:
        try:
            return enum.parse(value, argument=key)
        except ValueError:
            choices = ", ".join(member.value for member in enum)
            raise ValueError(f"{key} must be one of {choices}, got {value!r}") from None

    return check


def _optional(check: Check) -> Check:
    def optional(value: Any, key: str) -> Any:
        return None if value is None else check(value, key)

    return optional


def _num_processes(value: Any, key: str) -> int | None:
    number = _int(value, key)
    if number == -1:  # what Accelerate writes for "decide at launch"
        return None
    if number < 1:
        raise ValueError(f"{key} must be >= 1 (or -1 to decide at launch), got {number}")
    return number


def _gpu_ids(value: Any, key: str) -> str:
    text = str(value).strip() if isinstance(value, str | int) and not isinstance(value, bool) else ""
    if text.lower() == "all":
        return "all"
    parts = [part.strip() for part in text.split(",")]
    if not text or not all(part.isdigit() for part in parts):
        raise ValueError(f"{key} must be 'all' or GPU numbers such as '0,1', got {value!r}")
    return ",".join(parts)


_FIELD_CHECKS: dict[str, Check] = {
    "compute_environment": _compute_environment,
    "distributed_type": _enum(DistributedType),
    "mixed_precision": _enum(PrecisionType),
    "use_cpu": _bool,
    "debug": _bool,
    "num_processes": _optional(_num_processes),
    "num_machines": _int_range(1),
    "machine_rank": _int_range(0),
    "gpu_ids": _optional(_gpu_ids),
    "main_process_ip": _optional(_str),
    "main_process_port": _optional(_int_range(1, 65535)),
    "rdzv_backend": _choice("static", "c10d", "etcd", "etcd-v2"),
    "same_network": _bool,
    "main_training_function": _str,
    "enable_cpu_affinity": _bool,
    "downcast_bf16": _bool,
    "gradient_accumulation_steps": _optional(_int_range(1)),
    "dynamo_config": _section(DYNAMO_CONFIG_KEYS),
    "fsdp_config": _section(FSDP_CONFIG_KEYS),
    "deepspeed_config": _section(DEEPSPEED_CONFIG_KEYS),
    "megatron_lm_config": _open_section,
    "parallelism_config": _open_section,
    "tp_config": _open_section,
    "fp8_config": _open_section,
    "mpirun_config": _open_section,
}


def _check_consistency(values: Mapping[str, Any]) -> None:
    machines, rank, processes = values["num_machines"], values["machine_rank"], values["num_processes"]
    if rank >= machines:
        raise ValueError(f"machine_rank must be < num_machines ({machines}), got {rank}")
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


def _validated(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Check and normalize every field; errors become ConfigFileError prefixed with ``source``."""
    try:
        result = {name: check(values[name], name) for name, check in _FIELD_CHECKS.items()}
        _check_consistency(result)
    except ValueError as error:
        raise ConfigFileError(f"{source}: {error}") from None
    return result


# --- the file -----------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ClusterConfig:
    """The settings of ``default_config.yaml``, with Accelerate's key names and defaults.

    Unset values are ``None`` (``num_processes``, ``gpu_ids``, ``main_process_ip``, ``main_process_port``,
    ``gradient_accumulation_steps``): the launcher decides them. Sections are plain dicts of YAML values
    (empty when absent), checked against :data:`FSDP_CONFIG_KEYS`, :data:`DYNAMO_CONFIG_KEYS` and
    :data:`DEEPSPEED_CONFIG_KEYS`.

    Example:
        >>> ClusterConfig(distributed_type="MULTI_GPU", num_processes=-1, mixed_precision="bf16").num_processes
        >>> ClusterConfig.from_dict({"num_processes": "two"})
        Traceback (most recent call last):
        lockstep.config.file.ConfigFileError: <dict>: num_processes must be an integer, got 'two'
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
    """Machines (nodes) in the job."""
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
    dynamo_config: dict[str, Any] = field(default_factory=dict)
    """torch.compile settings (dynamo_backend, dynamo_mode, ...); empty when not compiling."""
    fsdp_config: dict[str, Any] = field(default_factory=dict)
    """FSDP settings (fsdp_version, fsdp_auto_wrap_policy, ...); used when distributed_type is FSDP."""
    deepspeed_config: dict[str, Any] = field(default_factory=dict)
    """DeepSpeed settings (zero_stage, ...); used when distributed_type is DEEPSPEED."""
    megatron_lm_config: dict[str, Any] = field(default_factory=dict)
    """Megatron-LM settings, kept as written."""
    parallelism_config: dict[str, Any] = field(default_factory=dict)
    """N-D parallelism sizes (data / tensor / context parallel), kept as written."""
    tp_config: dict[str, Any] = field(default_factory=dict)
    """Tensor parallel settings of older Accelerate versions, kept as written."""
    fp8_config: dict[str, Any] = field(default_factory=dict)
    """FP8 recipe settings, kept as written."""
    mpirun_config: dict[str, Any] = field(default_factory=dict)
    """mpirun settings (mpirun_hostfile, mpirun_ccl), kept as written."""

    def __post_init__(self) -> None:
        values = {item.name: getattr(self, item.name) for item in fields(self)}
        for name, value in _validated(values, source="ClusterConfig").items():
            setattr(self, name, value)

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
                _compute_environment(data["compute_environment"], "compute_environment")
        except ValueError as error:
            raise ConfigFileError(f"{source}: {error}") from None
        _reject_unknown_keys(data, source)
        _warn_ignored_keys(data, source)
        values = {item.name: _default(item) for item in fields(cls)}
        values.update({name: value for name, value in data.items() if name in values and value is not None})
        return cls(**_validated(values, source))

    def to_dict(self) -> dict[str, Any]:
        """The mapping written to the file: Accelerate's keys, plain values, no unset values or empty sections."""
        result: dict[str, Any] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, DistributedType | PrecisionType):
                value = value.value
            if value is None or (isinstance(value, dict) and not value):
                continue
            result[item.name] = dict(value) if isinstance(value, dict) else value
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
        if "mixed_precision" not in data and fp16 is not None and _bool(fp16, "fp16"):
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


def _reject_unknown_keys(data: Mapping[str, Any], source: str) -> None:
    unknown = [key for key in data if key not in _FIELD_CHECKS and not _is_ignored(key)]
    if unknown:
        raise ConfigFileError(
            f"{source}: {unknown[0]} is not a known key (known: {', '.join(sorted(_FIELD_CHECKS))})"
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
    """Write ``config`` as YAML with Accelerate's key names, creating folders; returns the path.

    The write is atomic (a temporary file renamed over the target), so a crash never leaves half a file.
    """
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(yaml.safe_dump(config.to_dict(), sort_keys=True), encoding="utf-8")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path
