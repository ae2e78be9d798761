"""Which DeepSpeed plugins the Accelerator trains with: the ones given, else the launcher's.

``Accelerator(deepspeed_plugin=plugin)``, ``deepspeed_plugin={"name": plugin, ...}`` or Accelerate's
``deepspeed_plugins={...}``; without one, ``distributed_type: DEEPSPEED`` in the launcher's config (or
``ACCELERATE_USE_DEEPSPEED=true``, as Accelerate's launcher sets) builds one from the ``deepspeed_config``
section. The first plugin is the active one. The Accelerator's accumulation steps and mixed precision,
when not given, are taken from the DeepSpeed config; given, a different value in it is an error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lockstep.backends.deepspeed.plugin import DeepSpeedPlugin, str_to_bool
from lockstep.config.backend_specs import launched_plugin


def resolve_deepspeed(
    plugin: Any, plugins: Any, launch: Mapping[str, Any]
) -> dict[str, DeepSpeedPlugin] | None:
    """The named DeepSpeed plugins, the active one first; None when DeepSpeed is not used.

    Raises:
        ValueError: both arguments given, or an empty dict.
        TypeError: something other than a ``DeepSpeedPlugin``.
    """
    if plugin is not None and plugins is not None:
        raise ValueError(
            "Accelerator(deepspeed_plugin=..., deepspeed_plugins=...): pass the plugins once (deepspeed_plugins is "
            "Accelerate's other name for a dict of them)."
        )
    given = plugin if plugin is not None else plugins
    if given is None:
        given = launched_plugin(launch, "deepspeed_plugin")
        if given is None and str_to_bool(os.environ.get("ACCELERATE_USE_DEEPSPEED", "false")):
            given = DeepSpeedPlugin()
        if given is None:
            return None
    named = dict(given) if isinstance(given, Mapping) else {"default": given}
    if not named:
        raise ValueError(
            "Accelerator(deepspeed_plugin={}): the dict of DeepSpeed plugins is empty; give at least one."
        )
    for name, each in named.items():
        if not isinstance(each, DeepSpeedPlugin):
            raise TypeError(
                f"DeepSpeed plugin {name!r} must be a lockstep DeepSpeedPlugin, got {type(each).__name__}."
            )
    first = next(iter(named.values()))
    if not any(p.selected for p in named.values()):
        first.select(_from_accelerator_state=True)
    return named


def accumulation_from_config(plugin: DeepSpeedPlugin, steps: int, *, given: bool) -> int:
    """The Accelerator's accumulation steps: the config's when the Accelerator was given none.

    Raises:
        ValueError: both give a number and they differ.
    """
    configured = plugin.get_value("gradient_accumulation_steps")
    if configured in (None, "auto"):
        return steps
    if given and int(configured) != steps:
        raise ValueError(
            f"gradient_accumulation_steps={steps} contradicts the DeepSpeed config's gradient_accumulation_steps="
            f'{configured}. Give the same number in both, or write "auto" in the DeepSpeed config.'
        )
    return int(configured)


def precision_from_config(plugin: DeepSpeedPlugin, mixed_precision: str, *, given: bool) -> str:
    """The Accelerator's mixed precision: the config's fp16/bf16 when the Accelerator was given none (a
    different one given is refused by ``DeepSpeedPlugin.set_mixed_precision``)."""
    if given:
        return mixed_precision
    return plugin.mixed_precision_of_config()
