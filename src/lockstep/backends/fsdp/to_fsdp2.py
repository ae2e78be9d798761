"""Converting a config file's ``fsdp_config`` from FSDP1 to FSDP2, as ``accelerate to-fsdp2`` does.

Everything is derived from the FSDP key table (:data:`lockstep.backends.fsdp.keys.FSDP_KEYS`): the keys that
only FSDP1 had (``legacy``) are removed, except the sharding strategy, which becomes
``fsdp_reshard_after_forward``; FSDP1 strategy names under ``fsdp_reshard_after_forward`` become its bool;
every other key is kept as written, and ``fsdp_version`` becomes 2. A file that already says
``fsdp_version: 2``, or has no ``fsdp_config``, is left as it is. The other sections are not touched.

This module must not import torch.

Example:
    >>> result = convert_to_fsdp2(
    ...     {"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": "SHARD_GRAD_OP",
    ...      "fsdp_use_orig_params": True, "fsdp_offload_params": False}}
    ... )
    >>> result.config["fsdp_config"]
    {'fsdp_reshard_after_forward': False, 'fsdp_offload_params': False, 'fsdp_version': 2}
    >>> result.notes
    ['fsdp_sharding_strategy SHARD_GRAD_OP became fsdp_reshard_after_forward: false', 'removed fsdp_use_orig_params: FSDP2 has no such setting']
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lockstep.backends.fsdp.keys import FSDP1_RESHARD, FSDP_KEYS
from lockstep.config import checks
from lockstep.config.keys import SettingKey, file_keys

RESHARD_OF_STRATEGY: dict[str, bool] = {
    **FSDP1_RESHARD,
    "HYBRID_SHARD": True,
    "HYBRID_SHARD_ZERO2": False,
    "NO_SHARD": False,
}
"""Every FSDP1 sharding strategy as FSDP2's ``reshard_after_forward`` (Accelerate's mapping). FSDP2 still
shards parameters for ``NO_SHARD`` and shards over all processes for the hybrid strategies."""
_KEYS = file_keys(FSDP_KEYS)
_STRATEGY = next(entry for entry in FSDP_KEYS if entry.field == "sharding_strategy" and entry.file)
_RESHARD = next(entry for entry in FSDP_KEYS if entry.field == "reshard_after_forward")
_VERSION = next(entry for entry in FSDP_KEYS if entry.field == "fsdp_version")
_WHERE = "fsdp_config"


@dataclass
class Conversion:
    """The converted config and what happened to it."""

    config: dict[str, Any]
    """The whole config, with its ``fsdp_config`` converted (the input is not changed)."""
    converted: bool
    """False when there was nothing to convert (no FSDP section, or already FSDP2)."""
    notes: list[str] = field(default_factory=list)
    """One line per key that was renamed, translated or removed, or why nothing was converted."""


def convert_to_fsdp2(config: Mapping[str, Any]) -> Conversion:
    """Convert the ``fsdp_config`` of a config file's mapping from FSDP1 to FSDP2.

    Raises:
        ValueError: a sharding strategy or ``fsdp_reshard_after_forward`` value that is no FSDP setting,
            naming ``fsdp_config.KEY``.
    """
    result = dict(config)
    section = config.get(_WHERE) or {}
    if not isinstance(section, Mapping):
        raise ValueError(f"{_WHERE} must be a mapping of settings, got {section!r}")
    if not section:
        return Conversion(result, converted=False, notes=["no fsdp_config section: nothing to convert"])
    version = section.get(_VERSION.key)
    if version is not None and _VERSION.check(version, f"{_WHERE}.{_VERSION.key}") == 2:
        note = (
            "the config already says fsdp_version: 2, so nothing was converted; if it still uses FSDP1 "
            "settings, set fsdp_version: 1 and run again"
        )
        return Conversion(result, converted=False, notes=[note])
    converted: dict[str, Any] = {}
    notes: list[str] = []
    for key, value in section.items():
        entry = _KEYS.get(key)
        if entry is None or value is None or not (entry.legacy or entry is _RESHARD):
            converted[key] = value  # FSDP2 keys, and keys of no FSDP setting, are kept as written
        elif entry is _STRATEGY or entry is _RESHARD:
            converted[_RESHARD.key] = _reshard_value(entry, value, notes)
        else:
            notes.append(f"removed {key}: FSDP2 has no such setting")
    converted[_VERSION.key] = 2
    result[_WHERE] = converted
    return Conversion(result, converted=True, notes=notes)


def _reshard_value(entry: SettingKey, value: Any, notes: list[str]) -> Any:
    """``fsdp_reshard_after_forward`` for a sharding strategy (or an FSDP1 name under the key itself)."""
    path = f"{_WHERE}.{entry.key}"
    checked = checks.sharding_strategy(value, path) if entry is _STRATEGY else entry.check(value, path)
    if isinstance(checked, bool):
        return checked
    reshard = RESHARD_OF_STRATEGY[checked]
    target = _RESHARD.key if entry is _STRATEGY else entry.key
    notes.append(f"{entry.key} {checked} became {target}: {str(reshard).lower()}")
    return reshard
