"""The table of layers: what runs around every training step beside the backend, registered by the layer.

A layer is not a way to train: it adds to whichever backend trains, through the step hooks of
:mod:`lockstep.step_hooks` (count, time or veto steps, note progress, take part in the commit). Its
:class:`LayerSpec` declares its whole vocabulary (its config type, ``Accelerator`` keyword,
``TrainingArguments`` field, config-file section with its key table and launch switch, the launcher's checks,
a service beside the workers) and how it builds its hooks, so that adding one is one folder:

- a built-in layer is a folder of :mod:`lockstep.layers` whose ``spec.py`` calls :func:`register_layer` on
  import (fault tolerance: :mod:`lockstep.layers.fault_tolerance.spec`);
- code registers it with :func:`register_layer`;
- an installed package declares it in the ``lockstep.layers`` entry-point group (a ``LayerSpec``, an iterable
  of them, a callable returning either, or a module that calls :func:`register_layer` on import), read on the
  table's first use.

From its spec, ``lockstep launch`` takes the switch and the section's flags, the config file takes the
section, the Accelerator takes the keyword (or, when it is not given, the section ``lockstep launch`` passed
to the workers) and ``TrainingArguments`` gains the field (a layer registered in code after
``lockstep.trainer`` was imported has no field: register it before, or install it). The Accelerator calls
``step_hooks(plugin, accelerator)`` once and runs the hooks it returns on every step.

This module must not import torch.

Example:
    >>> spec = LayerSpec(name="doc_layer", step_hooks=lambda plugin, accelerator: ())
    >>> spec.add_on, spec.distributed_types
    (True, ())
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from lockstep.config.vocabulary import Vocabulary, import_built_in_specs, resolve_target
from lockstep.entry_points import Registry

ENTRY_POINT_GROUP = "lockstep.layers"
"""The entry-point group an installed package registers its layers under."""

HookBuilder = Callable[[Any, Any], Iterable[Any]]
"""``(plugin, accelerator) -> step hooks``: builds the layer's :class:`~lockstep.step_hooks.StepHook` objects
for one Accelerator (called once, when the Accelerator is built)."""


@dataclass(frozen=True, kw_only=True)
class LayerSpec(Vocabulary):
    """One layer, as the rest of lockstep sees it: its vocabulary and how it hooks the step.

    Example:
        >>> LayerSpec(name="x", step_hooks="my_layer.hooks:build", config_section="x_config").section_keys
        {}
    """

    step_hooks: str | HookBuilder
    """Builds its step hooks: a callable ``(plugin, accelerator) -> hooks``, or ``"module:function"`` imported
    on first use (keeps the spec torch-free)."""

    from_layout: str | Callable[[Any], Any] | None = None
    """For a layer that a setting of the layout turns on, without a keyword or section of its own (expert
    parallelism: ``ParallelismConfig(ep_size=...)``): ``(parallelism_config) -> plugin``, None when it stays
    off; a callable or ``"module:function"``. Asked when the Accelerator is built, with its layout."""

    add_on: ClassVar[bool] = True
    """Its section goes to the workers beside the backend's, chosen by its switch or its flags."""
    distributed_types: ClassVar[tuple[Any, ...]] = ()
    """A layer is never a config file's ``distributed_type``."""
    wizard: ClassVar[None] = None
    """``lockstep config`` does not ask about layers."""

    def build_hooks(self, plugin: Any, accelerator: Any) -> list[Any]:
        """The layer's step hooks for ``accelerator``, given its plugin (config) object."""
        return list(resolve_target(self.step_hooks)(plugin, accelerator))


LAYERS: Registry[LayerSpec] = Registry(
    noun="layer",
    function="register_layer",
    kind=LayerSpec,
    name_of=lambda spec: spec.name,
    order=lambda spec: spec.name,
    group=ENTRY_POINT_GROUP,
    built_ins=import_built_in_specs,  # each folder of lockstep.layers registers its layer (fault tolerance)
)
"""The table of layers."""


def register_layer(spec: LayerSpec, *, replace: bool = False) -> LayerSpec:
    """Add a layer to the table (its section, flags, keywords and field are read from ``spec``).

    Args:
        spec: the layer's vocabulary and hook builder.
        replace: replace a layer of the same name (else that is an error).

    Raises:
        TypeError: ``spec`` is not a :class:`LayerSpec`.
        ValueError: a layer of that name is registered already.
    """
    return LAYERS.register(spec, replace=replace)


def unregister_layer(name: str) -> None:
    """Remove a registered layer (tests, notebooks that redefine one); unknown names are ignored."""
    LAYERS.unregister(name)


def layers_from_layout(layout: Any) -> list[tuple[LayerSpec, Any]]:
    """The layers ``layout`` (a ``ParallelismConfig``, or None) turns on, each with its plugin (see
    :attr:`LayerSpec.from_layout`)."""
    if layout is None:
        return []
    found = []
    for spec in layer_specs():
        plugin = None if spec.from_layout is None else resolve_target(spec.from_layout)(layout)
        if plugin is not None:
            found.append((spec, plugin))
    return found


def layer_specs() -> list[LayerSpec]:
    """Every registered layer, in the order their hooks run (by name)."""
    return LAYERS.entries()
