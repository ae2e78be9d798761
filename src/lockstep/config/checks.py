"""Value checks for settings: each takes ``(value, key path)`` and returns the normalized value.

A check raises ValueError naming the key path, e.g. ``fsdp_config.fsdp_min_num_params must be >= 0, got -1``.
The key tables (:mod:`lockstep.config.keys`) name a check per key, so the config file, the ``lockstep
launch`` flags and the Trainer's ``fsdp_config`` accept the same values. Checks take what YAML, JSON and
command-line text produce: ``'true'``, ``1``, ``'1e8'``.

This module must not import torch.

Example:
    >>> int_range(1, 2)("2", "fsdp_config.fsdp_version")
    2
    >>> choice("NO_WRAP", "SIZE_BASED_WRAP")("size_based_wrap", "fsdp_config.fsdp_auto_wrap_policy")
    'SIZE_BASED_WRAP'
    >>> boolean("maybe", "use_cpu")
    Traceback (most recent call last):
    ValueError: use_cpu must be true or false, got 'maybe'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lockstep.config.activation_policy import POLICIES, parse_activation_policy
from lockstep.config.enums import DistributedType, DynamoBackend, PrecisionType
from lockstep.config.keys import Check, SettingKey

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
"""FSDP1's sharding strategies, in the order of their old 1-based numbers."""


# --- scalars ------------------------------------------------------------------------------------------


def boolean(value: Any, key: str) -> bool:
    """``true``/``false`` (also yes/no, on/off, 1/0, in any case)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()  # str(): also numpy bools and other bool-like objects
    if text in _TRUE | _FALSE:
        return text in _TRUE
    raise ValueError(f"{key} must be true or false, got {value!r}")


def integer(value: Any, key: str) -> int:
    """An integer; also a whole float or text such as ``'1e8'`` (which YAML 1.1 leaves as a string)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    number: float | None = None
    if isinstance(value, float):
        number = value
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if number is not None and number.is_integer():
        return int(number)
    raise ValueError(f"{key} must be an integer, got {value!r}")


def string(value: Any, key: str) -> str:
    """Non-empty text, stripped."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{key} must be a non-empty string, got {value!r}")
    return value.strip()


def int_range(low: int, high: int | None = None) -> Check:
    """An integer (see :func:`integer`) that is ``>= low`` and, with ``high``, ``<= high``."""

    def check(value: Any, key: str) -> int:
        number = integer(value, key)
        if number < low or (high is not None and number > high):
            bounds = f">= {low}" if high is None else f"between {low} and {high}"
            raise ValueError(f"{key} must be {bounds}, got {number}")
        return number

    return check


def choice(*choices: str) -> Check:
    """One of ``choices``, in any case; returns the choice as spelled here. Enum members match by name."""

    def check(value: Any, key: str) -> str:
        text = value if isinstance(value, str) else getattr(value, "name", value)
        for option in choices:
            if str(text).strip().lower() == option.lower():
                return option
        raise ValueError(f"{key} must be one of {', '.join(choices)}, got {value!r}")

    return check


def auto_or(check: Check) -> Check:
    """``auto`` (left to the engine), or a value that ``check`` accepts."""

    def auto_or_value(value: Any, key: str) -> Any:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        return check(value, key)

    return auto_or_value


def optional(check: Check) -> Check:
    """None (unset), or a value that ``check`` accepts."""

    def optional_value(value: Any, key: str) -> Any:
        return None if value is None else check(value, key)

    return optional_value


def non_negative_float(value: Any, key: str) -> float:
    """A number ``>= 0``."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = -1.0
    if isinstance(value, bool) or not number >= 0:
        raise ValueError(f"{key} must be a number >= 0, got {value!r}")
    return number


def as_given(value: Any, key: str) -> Any:
    """Any value, unchanged: for settings that only their dataclass can check (modules, patterns)."""
    del key
    return value


# --- domain values ------------------------------------------------------------------------------------


def class_names(value: Any, key: str) -> str | list[str]:
    """Class names: one comma-separated string (kept as written) or a list of names."""
    if isinstance(value, list | tuple) and value and all(isinstance(item, str) and item for item in value):
        return list(value)
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise ValueError(f"{key} must be class names, comma-separated or as a list, got {value!r}")


def sharding_strategy(value: Any, key: str) -> str:
    """An FSDP1 sharding strategy by name, or by the 1-based number that Accelerate < 0.20 wrote."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= len(SHARDING_STRATEGIES):
        return SHARDING_STRATEGIES[value - 1]
    return choice(*SHARDING_STRATEGIES)(value, key)


def activation_policy(value: Any, key: str) -> bool | str:
    """An activation policy (:mod:`lockstep.config.activation_policy`): true/false (full/none, in any spelling
    :func:`boolean` takes) or a policy name such as ``op``, ``every_2`` or ``offload``."""
    try:
        return boolean(value, key)
    except ValueError:
        pass
    try:
        policy = parse_activation_policy(value, owner=key)
    except ValueError:
        raise ValueError(
            f"{key} must be true, false or an activation policy ({', '.join(POLICIES)}), got {value!r}"
        ) from None
    return policy.name if policy.mode not in ("full", "none") else policy.enabled


def reshard_after_forward(value: Any, key: str) -> bool | str:
    """FSDP2's bool, or the FSDP1 sharding strategy that Accelerate writes under the same key."""
    try:
        return boolean(value, key)
    except ValueError:
        pass
    try:
        return choice(*SHARDING_STRATEGIES)(value, key)
    except ValueError:
        raise ValueError(
            f"{key} must be true or false (FSDP2) or one of {', '.join(SHARDING_STRATEGIES)} (FSDP1), "
            f"got {value!r}"
        ) from None


def dynamo_backend(value: Any, key: str) -> str:
    """A ``torch.compile`` backend, as Accelerate writes it: the upper-case name (``INDUCTOR``)."""
    try:
        return DynamoBackend.parse(value, argument=key).name
    except ValueError:
        choices = ", ".join(member.value for member in DynamoBackend)
        raise ValueError(f"{key} must be one of {choices}, got {value!r}") from None


def enum_value(enum: type[DistributedType] | type[PrecisionType]) -> Check:
    """A member of ``enum``, by value or name in any case."""

    def check(value: Any, key: str) -> Any:
        try:
            return enum.parse(value, argument=key)
        except ValueError:
            choices = ", ".join(member.value for member in enum)
            raise ValueError(f"{key} must be one of {choices}, got {value!r}") from None

    return check


def compute_environment(value: Any, key: str) -> str:
    """``LOCAL_MACHINE``; SageMaker is refused with what to do instead."""
    if str(value).strip().upper() == "AMAZON_SAGEMAKER":
        raise ValueError(
            f"{key} AMAZON_SAGEMAKER is not supported: lockstep launches on machines you reach yourself. "
            "Set it to LOCAL_MACHINE (or run `lockstep config`) and start the job with `lockstep launch`"
        )
    return choice("LOCAL_MACHINE")(value, key)


def num_processes(value: Any, key: str) -> int | None:
    """Processes of the job, ``>= 1``; Accelerate's -1 ("decide at launch") becomes None."""
    number = integer(value, key)
    if number == -1:
        return None
    if number < 1:
        raise ValueError(f"{key} must be >= 1 (or -1 to decide at launch), got {number}")
    return number


def gpu_ids(value: Any, key: str) -> str:
    """``all`` or GPU numbers such as ``0,1`` (a single number may be an int)."""
    text = str(value).strip() if isinstance(value, str | int) and not isinstance(value, bool) else ""
    if text.lower() == "all":
        return "all"
    parts = [part.strip() for part in text.split(",")]
    if not text or not all(part.isdigit() for part in parts):
        raise ValueError(f"{key} must be 'all' or GPU numbers such as '0,1', got {value!r}")
    return ",".join(parts)


# --- sections -----------------------------------------------------------------------------------------


def section(schema: Mapping[str, SettingKey]) -> Check:
    """A mapping whose keys are the keys of ``schema``, each value checked by its key's check.

    None (an empty YAML section) is an empty dict; None values stay None.
    """

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


def open_section(value: Any, key: str) -> dict[str, Any]:
    """A mapping of settings kept as written (sections lockstep does not interpret yet)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(name, str) for name in value):
        raise ValueError(f"{key} must be a mapping of settings, got {value!r}")
    return dict(value)
