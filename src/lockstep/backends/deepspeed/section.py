"""The config file's ``deepspeed_config`` section as the launcher reads it: the plugin's keyword arguments,
the check that runs before any process starts, and what the DeepSpeed multi-node keys mean here.

This module imports neither torch nor deepspeed.

Example:
    >>> plugin_fields({"zero_stage": 3, "offload_optimizer_device": "none", "deepspeed_hostfile": "hosts"})
    {'zero_stage': 3, 'offload_optimizer_device': 'none'}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lockstep.backends.deepspeed.keys import DEEPSPEED_KEYS
from lockstep.backends.deepspeed.plugin import DeepSpeedPlugin
from lockstep.config.keys import by_spelling, section_kwargs

_LAUNCHER_KEYS = (
    "deepspeed_multinode_launcher",
    "deepspeed_hostfile",
    "deepspeed_exclusion_filter",
    "deepspeed_inclusion_filter",
)


def plugin_fields(section: Mapping[str, Any]) -> dict[str, Any]:
    """``DeepSpeedPlugin`` keyword arguments from a ``deepspeed_config`` section (launcher-only keys and None
    values left out).

    Raises:
        ValueError: a key of no DeepSpeed setting.
    """
    return section_kwargs(
        by_spelling(DEEPSPEED_KEYS, ""), section, prefix="", where="deepspeed_config", owner="DeepSpeedPlugin"
    )


def check_deepspeed_section(section: Mapping[str, Any], *, mixed_precision: str, accumulation: int) -> None:
    """Build the plugin the workers will build, and check it against the launch's mixed precision and
    accumulation steps.

    Raises:
        ValueError: a bad value, a config-file key that contradicts the DeepSpeed JSON config, or a mixed
            precision or accumulation that contradicts it.
    """
    plugin = DeepSpeedPlugin(**plugin_fields(section))
    plugin.set_mixed_precision(mixed_precision)
    configured = plugin.get_value("gradient_accumulation_steps")
    if accumulation != 1 and configured not in (None, "auto") and int(configured) != accumulation:
        raise ValueError(
            f"--gradient-accumulation-steps {accumulation} contradicts the DeepSpeed config's "
            f"gradient_accumulation_steps={configured}. Give one of them, or the same number in both."
        )


def deepspeed_launcher_notes(section: Mapping[str, Any]) -> list[str]:
    """One line per DeepSpeed multi-node launcher key given: lockstep reads them and does not use them."""
    given = [key for key in _LAUNCHER_KEYS if section.get(key) not in (None, "")]
    if not given:
        return []
    return [
        f"{', '.join(given)}: DeepSpeed's own launcher (pdsh, hostfiles) is not used; lockstep starts the processes "
        "of every machine with torch's elastic agent. Run `lockstep launch --num-machines N --machine-rank R "
        "--main-process-ip HOST ...` on each machine (the hostfile's hosts), with the same config file."
    ]
