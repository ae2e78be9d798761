"""What an extension declares about itself: its :class:`Vocabulary`, shared by backends and layers.

A backend (:class:`lockstep.config.backend_specs.BackendSpec`) and a layer
(:class:`lockstep.config.layer_specs.LayerSpec`) each name, in their own folder, the words users type to ask
for them: the plugin (config) type, the ``Accelerator`` keyword, the ``TrainingArguments`` field, the
config-file section with its key table (the launch flags are derived from it), the launch switch, the checks
the launcher runs before any process starts, and a service that runs beside the workers. Everything that
reads those words (the config file, the launcher's flags and settings, the Accelerator's keywords, the
Trainer's fields, ``lockstep env``) iterates over the registered specs and reads this one shape.

This module must not import torch.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lockstep.config.keys import SettingKey

SectionCheck = Callable[[dict[str, Any], Mapping[str, Any]], None]
"""Checks a section against the other launch settings; raises ``ValueError`` with the reason."""
LaunchService = Callable[[dict[str, Any], Any], contextlib.AbstractContextManager[dict[str, Any]]]
"""Runs beside the workers for a whole launch; yields the section the workers get."""


@dataclass(frozen=True, kw_only=True)
class Vocabulary:
    """The words of one extension (a backend or a layer), declared in its folder.

    Example:
        >>> Vocabulary(name="mine", config_section="mine_config").section_keys
        {}
    """

    name: str
    """Short name (``"fsdp"``); what ``lockstep env`` lists and errors name."""
    summary: str = ""
    """One line for people (``lockstep env``, the launch switch's help, the Trainer field's help)."""
    title: str = ""
    """The name people know it by (``FSDP``), before its launch flags' help; the name when empty."""
    plugin_type: str | type | None = None
    """Its plugin/config type (``"lockstep.layers.fault_tolerance.config:FaultToleranceConfig"``), imported on
    first use: what its ``Accelerator`` keyword takes and its section builds."""
    accelerator_argument: str | None = None
    """The ``Accelerator`` keyword its plugin is passed as (``fsdp_plugin``, ``fault_tolerance``)."""
    trainer_argument: str | None = None
    """The ``TrainingArguments`` field that asks the Trainer for it (``fsdp``, ``deepspeed``)."""
    trainer_normalize: str | Callable[[Any], None] | None = None
    """Checks its ``TrainingArguments`` field(s) in ``TrainingArguments.__post_init__`` and puts them in their
    parsed form, in place (``fsdp="full_shard offload"`` -> a list, ``deepspeed`` JSON text -> a dict); raises
    ``ValueError`` naming the field. A callable ``(arguments) -> None``, or ``"module:function"`` imported on
    first use (keeps specs torch-free)."""
    trainer_plugin: str | Callable[[Any, Any, dict[str, Any] | None], Any] | None = None
    """Builds its plugin from the ``TrainingArguments``, which the Trainer passes as ``accelerator_argument``:
    ``(arguments, model, launched) -> plugin``, None when its field is unset; ``launched`` is its config
    section as ``lockstep launch`` passed it when the launcher chose it too (raise ``ValueError`` where the
    arguments contradict it), else None. A callable, or ``"module:function"`` imported on first use."""
    config_section: str | None = None
    """The config-file section that configures it (``fsdp_config``)."""
    keys: tuple[SettingKey, ...] = ()
    """That section's key table (file keys and launch flags are derived from it)."""
    enable_flag: str | None = None
    """The launch switch (``use_fsdp`` for ``--use-fsdp``) that turns it on; a flag of its section too."""
    check_section: SectionCheck | None = None
    """Checks the section against the other launch settings (``mixed_precision``, ...) before any process
    starts; raises ``ValueError`` with the reason."""
    plugin_from_section: Callable[[dict[str, Any]], Any] | None = None
    """Builds its plugin from its section (as the launcher passed it to the workers, or a Trainer field's
    dict)."""
    launcher_notes: Callable[[dict[str, Any]], list[str]] | None = None
    """Settings of the section that have no effect, one line each (printed as warnings)."""
    requirement: str | None = None
    """The package it needs beyond torch (``deepspeed``), for ``lockstep env`` and errors."""
    launch_service: LaunchService | None = None
    """Runs beside the workers for the whole launch when its section is given (fault tolerance's lighthouse);
    entered with the section and the launch settings, it yields the section the workers get."""

    @property
    def section_keys(self) -> dict[str, SettingKey]:
        return {entry.key: entry for entry in self.keys}

    def resolved_plugin_type(self) -> type | None:
        return None if self.plugin_type is None else resolve_target(self.plugin_type)


BUILT_IN_PACKAGES = ("lockstep.backends", "lockstep.layers")
"""The packages whose subpackages hold the built-in extensions, each with a ``spec`` module that registers its
vocabulary on import (a backend's ``BackendSpec`` in ``lockstep.backends``, a layer's ``LayerSpec`` in
``lockstep.layers``: fault tolerance)."""


def import_built_in_specs() -> None:
    """Import every built-in extension's ``spec`` module, by name (``config/`` never imports ``backends/`` or
    ``layers/``: the specs import ``config/``), so that each registers itself; a folder of one of
    :data:`BUILT_IN_PACKAGES` is an extension, nothing lists it. A folder without a ``spec`` module, and a
    plain module (``lockstep.backends.ft``, fault tolerance's former path), is no extension."""
    for name in BUILT_IN_PACKAGES:
        package = importlib.util.find_spec(name)
        folders = list(package.submodule_search_locations or []) if package is not None else []
        for info in sorted(pkgutil.iter_modules(folders), key=lambda i: i.name):
            if info.ispkg:
                try:
                    importlib.import_module(f"{name}.{info.name}.spec")
                except ModuleNotFoundError as error:
                    if error.name != f"{name}.{info.name}.spec":
                        raise


def resolve_target(target: Any) -> Any:
    """``"module:name"`` imported (specs name what they build this way to stay torch-free); else ``target``."""
    if not isinstance(target, str):
        return target
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
