"""The table of ways to train: every backend's vocabulary, registered by the backend itself.

Each backend folder under ``lockstep/backends/`` has a ``spec.py`` that calls :func:`register_backend_spec`
with a :class:`BackendSpec`: its name, the plugin type it is built from, the ``distributed_type`` values
of a config file that mean it, its config-file section and key table, its launch switch, when it applies
(a predicate over the :class:`BackendRequest`) and how it builds itself. Everything that used to ask
"which backend?" iterates over :func:`backend_specs` instead: the backend registry
(:func:`lockstep.backends.registry.select_backend`), the config file's sections, the launch flags and the
launcher's checks, ``lockstep env``.

Built-in specs are found by looking for ``spec`` modules in the subpackages of ``lockstep.backends`` (a
new way to train is one folder: nothing lists it); installed packages add theirs through the
``lockstep.backends`` entry-point group, and user code through :func:`register_backend_spec` (or the
``register_backend`` class decorator in :mod:`lockstep.backends`). That discovery imports the spec
modules by name, which is how ``config/`` can read backend vocabularies without importing ``backends/``
(the spec modules import ``config/``, never the other way round).

This module must not import torch: ``lockstep launch`` and ``lockstep config`` read it at start-up, and
so must every ``spec.py``.

Example:
    >>> [spec.name for spec in backend_specs()][:3]
    ['fault_tolerant', 'deepspeed', 'pipeline']
    >>> spec_for_distributed_type("FSDP").config_section
    'fsdp_config'
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import pkgutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lockstep.config.enums import DistributedType
from lockstep.config.keys import SettingKey

BUILT_IN_PACKAGE = "lockstep.backends"
"""The package whose subpackages with a ``spec`` module are the built-in backends."""
ENTRY_POINT_GROUP = "lockstep.backends"
"""The entry-point group an installed package registers its backend specs under (each entry point names a
module that registers on import, or a callable returning a :class:`BackendSpec`)."""


@dataclass(frozen=True, kw_only=True)
class BackendRequest:
    """What the Accelerator resolved, that a backend is chosen and built from.

    Every field is the resolved setting (explicit argument, else launcher/config file): a backend's
    ``applies`` predicate reads them, and its ``build`` passes them on.
    """

    state: Any
    """The :class:`~lockstep.state.PartialState` (rank, world size, device)."""
    mixed_precision: Any = "no"
    autocast_kwargs: Any = None
    scaler_kwargs: Any = None
    ddp_kwargs: Any = None
    dynamo_plugin: Any = None
    fsdp_plugin: Any = None
    deepspeed_plugins: Mapping[str, Any] | None = None
    parallelism_config: Any = None
    plugins: tuple[Any, ...] = ()
    """Objects of registered backends' plugin types given in ``kwargs_handlers`` (user backends)."""

    def plugin_of(self, kind: type) -> Any:
        """The given plugin object of type ``kind`` (in ``plugins``), or None."""
        return next((p for p in self.plugins if isinstance(p, kind)), None)

    @property
    def layout_mesh_built(self) -> bool:
        """Whether a ``ParallelismConfig`` with a built device mesh was given."""
        return self.parallelism_config is not None and self.parallelism_config.device_mesh is not None


@dataclass(frozen=True)
class TypeFacts:
    """What Accelerate's public properties answer for a config file's ``distributed_type`` that a backend
    runs (declared in the backend's spec, read through :mod:`lockstep.config.topology`)."""

    multi_device: bool = False
    """Data parallel with one accelerator device per process (Accelerate's ``Accelerator.multi_device``)."""
    fsdp2: bool = False
    """The model is sharded with FSDP2 (Accelerate's ``is_fsdp2``)."""
    deepspeed: bool = False
    """DeepSpeed's engine trains it (Accelerate's ``deepspeed_required``)."""
    gpu_only: bool = False
    """It needs GPUs: ``--cpu`` contradicts it."""


Builder = Callable[[BackendRequest], Any]
"""Builds the backend (with its precision) for a request; returns a :class:`lockstep.backends.Backend`."""


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    """One way to train, as the rest of lockstep sees it.

    Example:
        >>> spec = BackendSpec(name="mine", priority=45, applies=lambda request: False, build="x:y")
        >>> spec.section_keys, spec.config_section
        ({}, None)
    """

    name: str
    """Short name (``"fsdp"``); what ``lockstep env`` lists and errors name."""
    applies: Callable[[BackendRequest], bool]
    """Whether this backend trains the request (asked in ``priority`` order; the first that applies wins).
    It may raise ``ValueError`` for a request that names this backend in a way it cannot run."""
    build: str | Builder
    """How it builds itself: a callable, or ``"module:function"`` imported on first use (keeps specs
    torch-free)."""
    priority: int = 50
    """Lower is asked first: DeepSpeed 10, pipeline 20, N-D 30, FSDP 40, DDP 90, one process 100."""
    summary: str = ""
    """One line for people (``lockstep env``, the launch switch's help)."""
    title: str = ""
    """The name people know it by (``FSDP``), before its launch flags' help; the name when empty."""
    plugin_type: str | type | None = None
    """The plugin/config type it is built from (``"lockstep.config.fsdp:FullyShardedDataParallelPlugin"``):
    an object of a registered plugin type given in ``Accelerator(kwargs_handlers=[...])`` is handed to
    the backend in :attr:`BackendRequest.plugins`."""
    accelerator_argument: str | None = None
    """The ``Accelerator`` keyword its plugin is passed as (``fsdp_plugin``); None: in ``kwargs_handlers``."""
    trainer_argument: str | None = None
    """The ``TrainingArguments`` field that asks the Trainer for it (``fsdp``, ``deepspeed``)."""
    distributed_types: tuple[DistributedType, ...] = ()
    """The config file's ``distributed_type`` values that mean this backend."""
    type_facts: Mapping[DistributedType, TypeFacts] = field(default_factory=dict)
    """What Accelerate's properties answer for each of its ``distributed_types`` (unlisted: all False)."""
    config_section: str | None = None
    """The config-file section that configures it (``fsdp_config``)."""
    keys: tuple[SettingKey, ...] = ()
    """That section's key table (file keys and launch flags are derived from it)."""
    enable_flag: str | None = None
    """The launch switch (``use_fsdp`` for ``--use-fsdp``) that selects it; a flag of its section too."""
    check_section: Callable[[dict[str, Any], Mapping[str, Any]], None] | None = None
    """Checks the section against the other launch settings (``mixed_precision``, ...) before any process
    starts; raises ``ValueError`` with the reason."""
    plugin_from_section: Callable[[dict[str, Any]], Any] | None = None
    """Builds its plugin from the section the launcher passed to the workers (``distributed_type`` chose it)."""
    launcher_notes: Callable[[dict[str, Any]], list[str]] | None = None
    """Settings of the section that have no effect, one line each (printed as warnings)."""
    wizard: Callable[[Any], dict[str, Any]] | None = None
    """``lockstep config``'s questions for it: ``wizard(ask)`` returns its config section (``ask`` is
    :data:`lockstep.config.answers.Ask`); None: the wizard does not offer it."""
    requirement: str | None = None
    """The package it needs beyond torch (``deepspeed``), for ``lockstep env`` and errors."""
    add_on: bool = False
    """Its section is chosen by its switch or its flags, not by ``distributed_type``, and goes to the workers
    beside the distributed type's (fault tolerance: each replica group is an ordinary job)."""
    launch_service: (
        Callable[[dict[str, Any], Any], contextlib.AbstractContextManager[dict[str, Any]]] | None
    ) = None
    """Runs beside the workers for the whole launch when its section is given (fault tolerance's lighthouse);
    entered with the section and the launch settings, it yields the section the workers get."""

    @property
    def section_keys(self) -> dict[str, SettingKey]:
        return {entry.key: entry for entry in self.keys}

    def build_backend(self, request: BackendRequest) -> Any:
        return _resolve(self.build)(request)

    def resolved_plugin_type(self) -> type | None:
        return None if self.plugin_type is None else _resolve(self.plugin_type)


def _resolve(target: Any) -> Any:
    if not isinstance(target, str):
        return target
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass
class _Registry:
    specs: dict[str, BackendSpec] = field(default_factory=dict)
    discovered: bool = False


_REGISTRY = _Registry()


def register_backend_spec(spec: BackendSpec, *, replace: bool = False) -> BackendSpec:
    """Add a way to train to the table.

    Args:
        spec: the backend's vocabulary.
        replace: replace a spec of the same name (else that is an error).

    Raises:
        ValueError: the name, a ``distributed_type`` or the config section is taken by another backend.
    """
    if not isinstance(spec, BackendSpec):
        raise TypeError(f"register_backend_spec() takes a BackendSpec, got {type(spec).__name__}.")
    taken = _REGISTRY.specs.get(spec.name)
    if taken is not None and not replace:
        raise ValueError(
            f"A backend named {spec.name!r} is registered already; pick another name, or pass replace=True."
        )
    for other in _REGISTRY.specs.values():
        if other.name == spec.name:
            continue
        shared = set(other.distributed_types) & set(spec.distributed_types)
        if shared:
            raise ValueError(
                f"Backend {spec.name!r} claims distributed_type {sorted(t.value for t in shared)}, which backend "
                f"{other.name!r} has; a distributed_type names one backend."
            )
        if spec.config_section is not None and spec.config_section == other.config_section:
            raise ValueError(
                f"Backend {spec.name!r} claims the config section {spec.config_section!r} of backend "
                f"{other.name!r}; give it a section of its own."
            )
    _REGISTRY.specs[spec.name] = spec
    return spec


def unregister_backend_spec(name: str) -> None:
    """Remove a registered backend (tests, notebooks that redefine one); unknown names are ignored."""
    _REGISTRY.specs.pop(name, None)


def backend_specs() -> list[BackendSpec]:
    """Every registered backend, in the order they are asked whether they apply."""
    _discover()
    return sorted(_REGISTRY.specs.values(), key=lambda spec: (spec.priority, spec.name))


def spec_for_distributed_type(distributed_type: str | DistributedType | None) -> BackendSpec | None:
    """The backend a config file's ``distributed_type`` means, or None (unset, unknown or not built)."""
    if distributed_type is None:
        return None
    try:
        member = DistributedType.parse(distributed_type, argument="distributed_type")
    except ValueError:
        return None
    return next((spec for spec in backend_specs() if member in spec.distributed_types), None)


def argument_plugins(**given: Any) -> tuple[Any, ...]:
    """The plugins given as ``Accelerator`` keywords that registered backends claim (``fault_tolerance=``),
    each checked against its backend's plugin type; None values are left out.

    Example:
        >>> argument_plugins(fault_tolerance=None)
        ()
        >>> argument_plugins(fault_tolerance={})
        Traceback (most recent call last):
        ...
        TypeError: Accelerator(fault_tolerance={}) takes a FaultToleranceConfig (the fault_tolerant backend's plugin), got a dict.
    """
    found = []
    for argument, value in given.items():
        if value is None:
            continue
        spec = next((s for s in backend_specs() if s.accelerator_argument == argument), None)
        kind = None if spec is None else spec.resolved_plugin_type()
        if spec is None or kind is None:
            raise TypeError(f"Accelerator({argument}=...) names no registered backend.")
        if not isinstance(value, kind):
            raise TypeError(
                f"Accelerator({argument}={value!r}) takes a {kind.__name__} (the {spec.name} backend's plugin), "
                f"got a {type(value).__name__}."
            )
        found.append(value)
    return tuple(found)


def launched_plugin(launch: Mapping[str, Any], argument: str) -> Any:
    """The plugin that ``lockstep launch`` (its flags and config file) asks for, when the backend it chose
    takes its plugin as the ``Accelerator`` keyword ``argument`` (``fsdp_plugin``); else None.

    Example:
        >>> launched_plugin({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}}, "fsdp_plugin").fsdp_version
        2
        >>> launched_plugin({"distributed_type": "FSDP"}, "deepspeed_plugin") is None
        True
    """
    spec = spec_for_distributed_type(launch.get("distributed_type"))
    if spec is None or spec.accelerator_argument != argument:
        spec = next((s for s in backend_specs() if s.add_on and s.accelerator_argument == argument), None)
        if spec is None or not launch.get(spec.config_section or ""):
            return None
    if spec.plugin_from_section is None:
        return None
    return spec.plugin_from_section(dict(launch.get(spec.config_section or "") or {}))


def launched_add_ons(launch: Mapping[str, Any]) -> tuple[Any, ...]:
    """The plugins of the add-on backends (fault tolerance) whose sections ``lockstep launch`` (its flags and
    config file) gives: what an ``Accelerator`` given none of their keywords trains with.

    Example:
        >>> launched_add_ons({"distributed_type": "MULTI_CPU"})
        ()
    """
    found = (
        launched_plugin(launch, spec.accelerator_argument)
        for spec in backend_specs()
        if spec.add_on and spec.accelerator_argument
    )
    return tuple(plugin for plugin in found if plugin is not None)


def add_on_arguments(values: Callable[[str], Any]) -> dict[str, Any]:
    """The ``Accelerator`` keywords of the add-on backends that take a ``TrainingArguments`` field, each with
    its plugin: ``values(field)`` is the field's value, a plugin object or a dict of the backend's config
    section (JSON text too), built into its plugin here; None stays None.

    Raises:
        ValueError: a field's text is not JSON.

    Example:
        >>> add_on_arguments(lambda field: None)
        {'fault_tolerance': None}
    """
    arguments = {}
    for spec in backend_specs():
        if not (spec.add_on and spec.trainer_argument and spec.accelerator_argument):
            continue
        value = values(spec.trainer_argument)
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as error:
                raise ValueError(
                    f"TrainingArguments({spec.trainer_argument}={values(spec.trainer_argument)!r}) is not JSON "
                    f"({error}): pass a dict of its {spec.config_section} keys "
                    f"({', '.join(entry.key for entry in spec.keys)})."
                ) from None
        if isinstance(value, Mapping) and spec.plugin_from_section is not None:
            value = spec.plugin_from_section(dict(value))
        arguments[spec.accelerator_argument] = value
    return arguments


def sectioned_specs() -> list[BackendSpec]:
    """The backends that have a config-file section."""
    return [spec for spec in backend_specs() if spec.config_section is not None]


def plugin_types() -> dict[type, BackendSpec]:
    """The plugin types of backends registered with one, each with its backend (imports the types)."""
    found: dict[type, BackendSpec] = {}
    for spec in backend_specs():
        kind = spec.resolved_plugin_type()
        if kind is not None:
            found[kind] = spec
    return found


def _discover() -> None:
    if _REGISTRY.discovered:
        return
    _REGISTRY.discovered = True
    # By name, as an entry point is loaded: config/ never imports backends/ (the specs import config/).
    package = importlib.util.find_spec(BUILT_IN_PACKAGE)
    folders = list(package.submodule_search_locations or []) if package is not None else []
    for info in sorted(pkgutil.iter_modules(folders), key=lambda i: i.name):
        if info.ispkg:
            try:
                importlib.import_module(f"{BUILT_IN_PACKAGE}.{info.name}.spec")
            except ModuleNotFoundError as error:
                if error.name != f"{BUILT_IN_PACKAGE}.{info.name}.spec":
                    raise
    _load_entry_points()


def _load_entry_points() -> None:
    from lockstep.entry_points import installed_entry_points

    for entry in installed_entry_points(ENTRY_POINT_GROUP):
        loaded = entry.load()
        if callable(loaded) and not isinstance(loaded, type):
            loaded = loaded()
        if isinstance(loaded, BackendSpec):
            register_backend_spec(loaded)
        elif isinstance(loaded, Iterable) and not isinstance(loaded, str | bytes):
            for spec in loaded:
                register_backend_spec(spec)
