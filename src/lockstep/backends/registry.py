"""The one place that decides which backend distributes the model: a loop over the registered backends.

Every way to train registers a :class:`~lockstep.config.backend_specs.BackendSpec` (its folder's
``spec.py``, an installed package's ``lockstep.backends`` entry point, or :func:`register_backend` in user
code); :func:`select_backend` asks them in priority order and builds the first that applies, with its
precision. Nothing else in lockstep asks which backend is active: the facade and the Trainer ask the
backend for a capability (:meth:`lockstep.backends.base.Backend.capability`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from lockstep.backends.base import Backend
from lockstep.config.backend_specs import (
    BackendRequest,
    BackendSpec,
    backend_specs,
    register_backend_spec,
    unregister_backend_spec,
)
from lockstep.config.enums import PrecisionType
from lockstep.state import PartialState

B = TypeVar("B", bound=type[Backend])


def select_backend(
    state: PartialState,
    *,
    mixed_precision: PrecisionType = PrecisionType.NO,
    autocast_kwargs: Any = None,
    scaler_kwargs: Any = None,
    ddp_kwargs: Any = None,
    dynamo_plugin: Any = None,
    fsdp_plugin: Any = None,
    deepspeed_plugins: Mapping[str, Any] | None = None,
    parallelism_config: Any = None,
    plugins: tuple[Any, ...] = (),
) -> Backend:
    """Build the first registered backend that applies to these settings, with its precision.

    The built-in order: DeepSpeed whenever a plugin is given (even with one process); a
    ``ParallelismConfig`` with a pipeline dimension gets the pipeline backend, one with a tensor, context
    or sharded data-parallel dimension the N-D backend; FSDP whenever its plugin is given (even with one
    process, so that checkpoints have the same sharded format whatever the number of processes); a user
    backend when its plugin object is among ``plugins``; DDP for several processes; else one process.

    Example:
        >>> from lockstep.state import PartialState
        >>> type(select_backend(PartialState(cpu=True))).__name__
        'SingleProcessBackend'
    """
    request = BackendRequest(
        state=state,
        mixed_precision=mixed_precision,
        autocast_kwargs=autocast_kwargs,
        scaler_kwargs=scaler_kwargs,
        ddp_kwargs=ddp_kwargs,
        dynamo_plugin=dynamo_plugin,
        fsdp_plugin=fsdp_plugin,
        deepspeed_plugins=deepspeed_plugins,
        parallelism_config=parallelism_config,
        plugins=tuple(plugins),
    )
    return build_backend(request)


def build_backend(request: BackendRequest) -> Backend:
    """Build the first registered backend that applies to ``request``.

    Raises:
        RuntimeError: no registered backend applies.
    """
    for spec in backend_specs():
        if spec.applies(request):
            backend = spec.build_backend(request)
            if not isinstance(backend, Backend):
                raise TypeError(
                    f"The backend {spec.name!r} built a {type(backend).__name__}, not a lockstep.backends.Backend: "
                    "its build function must return an instance of a Backend subclass."
                )
            return backend
    names = ", ".join(spec.name for spec in backend_specs())
    raise RuntimeError(f"No registered backend applies to these settings (registered: {names}).")


def register_backend(
    name: str,
    *,
    plugin_type: type,
    priority: int = 50,
    summary: str = "",
    build: Callable[[BackendRequest], Backend] | None = None,
    replace: bool = False,
) -> Callable[[B], B]:
    """Register a backend class defined in your own code (a class decorator).

    The backend trains every ``Accelerator`` given an object of ``plugin_type`` in ``kwargs_handlers``; it
    is built with ``build(request)`` when given, else as ``cls(request.state, precision=Precision(...),
    dynamo_plugin=...)`` followed by ``backend.plugin = <the plugin object>``. Subclass
    :class:`~lockstep.backends.Backend`: implement ``wrap_model`` and override what your strategy changes
    (``no_sync``, ``clip_grad_norm_``, ``model_state_dicts``, ...); ``prepare``, ``backward``,
    ``accumulate``, ``clip_grad_norm_``, ``save_state``/``load_state`` and ``lockstep launch`` then run
    through it.

    Args:
        name: the backend's name (errors and ``lockstep env`` show it).
        plugin_type: the class of the object that selects the backend; pass an instance in
            ``Accelerator(kwargs_handlers=[...])``.
        priority: asked before the built-ins with a higher number (DDP is 90, one process 100; FSDP 40).
        summary: one line for ``lockstep env``.
        build: builds the backend from a :class:`~lockstep.config.backend_specs.BackendRequest`.
        replace: replace a backend registered under the same name.

    Example:
        >>> from dataclasses import dataclass
        >>> from torch import nn
        >>> @dataclass
        ... class AsIsPlugin:
        ...     label: str = "as-is"
        >>> @register_backend("as-is", plugin_type=AsIsPlugin)
        ... class AsIsBackend(Backend):
        ...     distributed_type = None
        ...     def wrap_model(self, model: nn.Module) -> nn.Module:
        ...         return model
        >>> from lockstep.state import PartialState
        >>> backend = select_backend(PartialState(cpu=True), plugins=(AsIsPlugin(),))
        >>> type(backend).__name__, backend.plugin.label
        ('AsIsBackend', 'as-is')
        >>> unregister_backend("as-is")
    """
    if not isinstance(plugin_type, type):
        raise TypeError(f"register_backend(plugin_type=...) takes a class, got {type(plugin_type).__name__}.")

    def decorate(cls: B) -> B:
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise TypeError(
                f"@register_backend({name!r}) decorates a subclass of lockstep.backends.Backend, got {cls!r}."
            )
        register_backend_spec(
            BackendSpec(
                name=name,
                summary=summary or (cls.__doc__ or "").strip().split("\n")[0],
                priority=priority,
                applies=lambda request: request.plugin_of(plugin_type) is not None,
                build=build or _default_builder(cls, plugin_type),
                plugin_type=plugin_type,
            ),
            replace=replace,
        )
        return cls

    return decorate


def unregister_backend(name: str) -> None:
    """Remove a backend registered with :func:`register_backend` (unknown names are ignored)."""
    unregister_backend_spec(name)


def _default_builder(cls: type[Backend], plugin_type: type) -> Callable[[BackendRequest], Backend]:
    def build(request: BackendRequest) -> Backend:
        from lockstep.precision import precision_for

        backend = cls(request.state, precision=precision_for(request), dynamo_plugin=request.dynamo_plugin)
        backend.plugin = request.plugin_of(plugin_type)  # type: ignore[attr-defined]
        return backend

    return build


def registered_backends() -> list[BackendSpec]:
    """Every registered backend's spec, in the order :func:`select_backend` asks them."""
    return backend_specs()


__all__ = ["build_backend", "register_backend", "registered_backends", "select_backend", "unregister_backend"]
