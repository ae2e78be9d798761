"""The table of setting groups: a config-file section that neither chooses the backend nor hooks the step.

The N-D layout (``parallelism_config``, declared in :mod:`lockstep.config.parallelism_keys`) is one: it
builds a ``ParallelismConfig``, which ``Accelerator(parallelism_config=...)`` takes as Accelerate's explicit
keyword and which the backends (N-D, pipeline) read. Its :class:`SettingSpec` declares its section and key
table, its launch switch, the launcher's check and how the section builds its object; the config file,
``lockstep launch`` (flags, settings, checks) and ``lockstep config`` read it through
:func:`lockstep.config.backend_specs.sectioned_specs`, beside the backends and layers.

A group is on when its section is given: by its switch, by one of its flags, or non-empty in the config
file. The workers get its section (empty: every default), or None when it is off.

Its vocabulary is owned by ``config/`` (the layout's keys are Accelerate's, read before any backend), so
the built-in groups are the modules of :data:`BUILT_IN_MODULES`, each registering its spec on import.

This module must not import torch.

Example:
    >>> [spec.config_section for spec in setting_specs()]
    ['parallelism_config']
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from lockstep.config.vocabulary import Vocabulary
from lockstep.entry_points import Registry

BUILT_IN_MODULES = ("lockstep.config.parallelism_keys",)
"""The modules that register the built-in setting groups on import."""


@dataclass(frozen=True, kw_only=True)
class SettingSpec(Vocabulary):
    """One setting group: its vocabulary, its ``lockstep config`` questions and its summary in a few words.

    Example:
        >>> spec = SettingSpec(name="mine", config_section="mine_config", enable_flag="use_mine")
        >>> spec.add_on, spec.distributed_types, spec.describe({"mine_size": 2})
        (True, (), '')
    """

    questions: Callable[[Any, int], dict[str, Any]] | None = None
    """``lockstep config``'s questions for it, offered among the ways to shard the model under its ``name``:
    ``questions(ask, processes)`` returns its section (``ask`` is :data:`lockstep.config.answers.Ask`).
    None: the wizard does not offer it."""
    summarize: Callable[[dict[str, Any]], str] | None = None
    """A given section in a few words (``device mesh tp=2``), for a config file's one-line summary."""

    add_on: ClassVar[bool] = True
    """Its section goes to the workers beside the backend's, when given (by its switch, flags or file)."""
    distributed_types: ClassVar[tuple[Any, ...]] = ()
    """A setting group is never a config file's ``distributed_type``."""

    def describe(self, section: dict[str, Any]) -> str:
        """The section in a few words, or ``""`` when it is not given or has no summary."""
        return self.summarize(section) if section and self.summarize is not None else ""


def _import_built_in_groups() -> None:
    for module in BUILT_IN_MODULES:
        importlib.import_module(module)


SETTING_GROUPS: Registry[SettingSpec] = Registry(
    noun="setting group",
    function="register_setting_spec",
    kind=SettingSpec,
    name_of=lambda spec: spec.name,
    order=lambda spec: spec.name,
    built_ins=_import_built_in_groups,
)
"""The table of setting groups (no entry-point group: a capability that adds settings is a layer)."""


def register_setting_spec(spec: SettingSpec, *, replace: bool = False) -> SettingSpec:
    """Add a setting group to the table.

    Raises:
        TypeError: ``spec`` is not a :class:`SettingSpec`.
        ValueError: a group of that name is registered already.
    """
    return SETTING_GROUPS.register(spec, replace=replace)


def unregister_setting_spec(name: str) -> None:
    """Remove a registered setting group (tests, notebooks that redefine one); unknown names are ignored."""
    SETTING_GROUPS.unregister(name)


def setting_specs() -> list[SettingSpec]:
    """Every registered setting group, by name."""
    return SETTING_GROUPS.entries()
