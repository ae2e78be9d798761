"""The table of ways to train: every backend's vocabulary, registered by the backend itself.

Each backend folder under ``lockstep/backends/`` has a ``spec.py`` that calls :func:`register_backend_spec`
with a :class:`BackendSpec`: its name, the plugin type it is built from, the ``distributed_type`` values
of a config file that mean it, its config-file section and key table, its launch switch, when it applies
(a predicate over the :class:`BackendRequest`) and how it builds itself. Everything that used to ask
"which backend?" iterates over :func:`backend_specs` instead: the backend registry
(:func:`lockstep.backends.registry.select_backend`), the config file's sections, the launch flags and the
launcher's checks, ``lockstep env``. What goes beside the chosen backend (fault tolerance) is a layer, with
the same :class:`~lockstep.config.vocabulary.Vocabulary`: :mod:`lockstep.config.layer_specs`, one folder of
:mod:`lockstep.layers` each.

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
    ['deepspeed', 'pipeline', 'nd']
    >>> spec_for_distributed_type("FSDP").config_section
    'fsdp_config'
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from lockstep.config.enums import DistributedType
from lockstep.config.layer_specs import layer_specs
from lockstep.config.setting_specs import setting_specs
from lockstep.config.vocabulary import Vocabulary, import_built_in_specs, resolve_target
from lockstep.entry_points import Registry

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
class BackendSpec(Vocabulary):
    """One way to train, as the rest of lockstep sees it: its :class:`~lockstep.config.vocabulary.Vocabulary`
    (plugin type, keywords, config section, flags, checks), when it applies and how it builds itself.

    Example:
        >>> spec = BackendSpec(name="mine", priority=45, applies=lambda request: False, build="x:y")
        >>> spec.section_keys, spec.config_section
        ({}, None)
    """

    applies: Callable[[BackendRequest], bool]
    """Whether this backend trains the request (asked in ``priority`` order; the first that applies wins).
    It may raise ``ValueError`` for a request that names this backend in a way it cannot run."""
    build: str | Builder
    """How it builds itself: a callable, or ``"module:function"`` imported on first use (keeps specs
    torch-free)."""
    priority: int = 50
    """Lower is asked first: DeepSpeed 10, pipeline 20, N-D 30, FSDP 40, DDP 90, one process 100."""
    distributed_types: tuple[DistributedType, ...] = ()
    """The config file's ``distributed_type`` values that mean this backend."""
    type_facts: Mapping[DistributedType, TypeFacts] = field(default_factory=dict)
    """What Accelerate's properties answer for each of its ``distributed_types`` (unlisted: all False)."""
    wizard: Callable[[Any], dict[str, Any]] | None = None
    """``lockstep config``'s questions for it: ``wizard(ask)`` returns its config section (``ask`` is
    :data:`lockstep.config.answers.Ask`); None: the wizard does not offer it."""
    add_on: ClassVar[bool] = False
    """A backend is chosen by ``distributed_type`` (or its switch); what goes beside it is a layer
    (:class:`~lockstep.config.layer_specs.LayerSpec`, whose ``add_on`` is True)."""

    def build_backend(self, request: BackendRequest) -> Any:
        return resolve_target(self.build)(request)


def _no_shared_words(spec: BackendSpec, others: list[BackendSpec]) -> None:
    """A ``distributed_type`` and a config section each name one backend."""
    for other in others:
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


BACKENDS: Registry[BackendSpec] = Registry(
    noun="backend",
    function="register_backend_spec",
    kind=BackendSpec,
    name_of=lambda spec: spec.name,
    order=lambda spec: (spec.priority, spec.name),
    group=ENTRY_POINT_GROUP,
    built_ins=import_built_in_specs,  # each folder of lockstep.backends registers its backend
    check=_no_shared_words,
)
"""The table of ways to train."""


def register_backend_spec(spec: BackendSpec, *, replace: bool = False) -> BackendSpec:
    """Add a way to train to the table.

    Args:
        spec: the backend's vocabulary.
        replace: replace a spec of the same name (else that is an error).

    Raises:
        ValueError: the name, a ``distributed_type`` or the config section is taken by another backend.
    """
    return BACKENDS.register(spec, replace=replace)


def unregister_backend_spec(name: str) -> None:
    """Remove a registered backend (tests, notebooks that redefine one); unknown names are ignored."""
    BACKENDS.unregister(name)


def backend_specs() -> list[BackendSpec]:
    """Every registered backend, in the order they are asked whether they apply."""
    return BACKENDS.entries()


def spec_for_distributed_type(distributed_type: str | DistributedType | None) -> BackendSpec | None:
    """The backend a config file's ``distributed_type`` means, or None (unset, unknown or not built)."""
    if distributed_type is None:
        return None
    try:
        member = DistributedType.parse(distributed_type, argument="distributed_type")
    except ValueError:
        return None
    return next((spec for spec in backend_specs() if member in spec.distributed_types), None)


def add_on_specs() -> list[Vocabulary]:
    """What goes beside the chosen backend when asked for: the layers (:mod:`lockstep.config.layer_specs`;
    fault tolerance is one)."""
    return list(layer_specs())


def sectioned_specs() -> list[Vocabulary]:
    """The backends, layers and setting groups (the N-D layout: :mod:`lockstep.config.setting_specs`) that
    have a config-file section, in that order.

    Raises:
        ValueError: two of them claim one config section, ``Accelerator`` keyword or ``TrainingArguments``
            field (a layer may be registered beside a backend that uses its words).
    """
    found = [
        spec
        for spec in (*backend_specs(), *layer_specs(), *setting_specs())
        if spec.config_section is not None
    ]
    for word in ("config_section", "accelerator_argument", "trainer_argument", "enable_flag"):
        owners: dict[str, str] = {}
        for spec in found:
            value = getattr(spec, word)
            if value is None:
                continue
            if value in owners and owners[value] != spec.name:
                raise ValueError(
                    f"{spec.name!r} and {owners[value]!r} both claim the {word.replace('_', ' ')} {value!r}; "
                    "each backend and layer needs words of its own: rename one."
                )
            owners[value] = spec.name
    return found


def given_add_ons(given: Mapping[str, Any], launch: Mapping[str, Any]) -> list[tuple[Vocabulary, Any]]:
    """The add-ons an ``Accelerator`` trains with, each with its plugin: the ones given as its keywords
    (``given``: keyword -> value; None is "not given"), else the ones whose section ``lockstep launch`` (its
    flags and config file) passed to the workers (``launch``).

    Raises:
        TypeError: a keyword no add-on claims, or a value that is not the add-on's plugin type.

    Example:
        >>> given_add_ons({}, {"distributed_type": "MULTI_CPU"})
        []
        >>> given_add_ons({"fault_tolerance": {}}, {})
        Traceback (most recent call last):
        ...
        TypeError: Accelerator(fault_tolerance={}) takes a FaultToleranceConfig (the fault_tolerance add-on's plugin), got a dict.
    """
    specs = {spec.accelerator_argument: spec for spec in add_on_specs() if spec.accelerator_argument}
    unknown = sorted(set(given) - set(specs))
    if unknown:
        raise TypeError(f"Accelerator.__init__() got an unexpected keyword argument {unknown[0]!r}")
    found: list[tuple[Vocabulary, Any]] = []
    for argument, spec in specs.items():
        value = given.get(argument)
        if value is None:
            value = launched_plugin(launch, argument)
            if value is None:
                continue
        kind = spec.resolved_plugin_type()
        if kind is not None and not isinstance(value, kind):
            raise TypeError(
                f"Accelerator({argument}={value!r}) takes a {kind.__name__} (the {spec.name} add-on's plugin), "
                f"got a {type(value).__name__}."
            )
        found.append((spec, value))
    return found


def launched_plugin(launch: Mapping[str, Any], argument: str) -> Any:
    """The plugin that ``lockstep launch`` (its flags and config file) asks for, when the backend it chose,
    or an add-on whose section it gives, takes its plugin as the ``Accelerator`` keyword ``argument``
    (``fsdp_plugin``); else None.

    Example:
        >>> launched_plugin({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}}, "fsdp_plugin").fsdp_version
        2
        >>> launched_plugin({"distributed_type": "FSDP"}, "deepspeed_plugin") is None
        True
    """
    spec: Vocabulary | None = spec_for_distributed_type(launch.get("distributed_type"))
    if spec is None or spec.accelerator_argument != argument:
        spec = next((s for s in add_on_specs() if s.accelerator_argument == argument), None)
        if spec is None or not launch.get(spec.config_section or ""):
            return None
    if spec.plugin_from_section is None:
        return None
    return spec.plugin_from_section(dict(launch.get(spec.config_section or "") or {}))


def add_on_arguments(values: Callable[[str], Any]) -> dict[str, Any]:
    """The ``Accelerator`` keywords of the add-ons that take a ``TrainingArguments`` field, each with its
    plugin: ``values(field)`` is the field's value (None where the arguments have no such field), a plugin
    object or a dict of the add-on's config section (JSON text too), built into its plugin here; None stays
    None.

    Raises:
        ValueError: a field's text is not JSON.

    Example:
        >>> add_on_arguments(lambda field: None)
        {'fault_tolerance': None}
    """
    arguments = {}
    for spec in add_on_specs():
        if not (spec.trainer_argument and spec.accelerator_argument):
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


def plugin_types() -> dict[type, Vocabulary]:
    """The plugin types of the backends and layers registered with one, each with its spec (imports the
    types)."""
    found: dict[type, Vocabulary] = {}
    for spec in [*backend_specs(), *layer_specs()]:
        kind = spec.resolved_plugin_type()
        if kind is not None:
            found[kind] = spec
    return found
