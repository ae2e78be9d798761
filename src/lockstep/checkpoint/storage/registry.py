"""The one place that turns a checkpoint location into its storage: a table of URL schemes.

A location's scheme picks its storage: a path with no scheme is a ``file`` location (as is ``file://...``),
served by :class:`~lockstep.checkpoint.storage.local.LocalStorage`; a scheme registered with
:func:`register_storage` (or found as an entry point of the ``lockstep.storages`` group, read on first use)
is served by what its factory builds; any other scheme that an ``fsspec`` file system serves (``s3``, ``gs``,
``az``, ``memory``, ...) by :class:`~lockstep.checkpoint.storage.fsspec_store.FsspecStorage`. Nothing outside
this folder looks at a location's scheme: it asks the storage (``local``, ``location``, ``join``, ...).

Example:
    >>> type(storage_for("runs/a")).__name__
    'LocalStorage'
    >>> scheme_of("s3://bucket/run"), scheme_of("runs/a")
    ('s3', 'file')
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lockstep.checkpoint.storage.base import CheckpointStorage, Location
from lockstep.checkpoint.storage.local import LocalStorage

StorageFactory = Callable[[str, dict[str, Any] | None], CheckpointStorage]
"""Builds the storage of a location: ``factory(location, storage_options)`` (a ``CheckpointStorage``
subclass whose ``__init__`` takes those two is one)."""

ENTRY_POINT_GROUP = "lockstep.storages"
"""Installed packages add storages as entry points of this group: the name is the scheme, the object the
factory (``vault = "my_package.storage:VaultStorage"``)."""

LOCAL_SCHEME = "file"
"""The scheme of a location written without one (a path)."""

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*$")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
logger = logging.getLogger("lockstep.checkpoint")


@dataclass
class _Registry:
    factories: dict[str, StorageFactory] = field(default_factory=dict)
    entry_points: dict[str, Any] = field(default_factory=dict)
    """Scheme -> an entry point not loaded yet (loaded when a location of that scheme is first asked for)."""
    discovered: bool = False


_REGISTRY = _Registry()


def scheme_of(location: Location) -> str:
    """The URL scheme of ``location``, lower case; ``file`` for a path written without one.

    Raises:
        TypeError: ``location`` is not a path or text.
    """
    if not isinstance(location, str | os.PathLike):
        raise TypeError(
            f"A checkpoint location is a path or a URL string, got {type(location).__name__} {location!r}."
        )
    text = os.fspath(location)
    match = _URL.match(text) if isinstance(text, str) else None
    return match.group(1).lower() if match else LOCAL_SCHEME


def register_storage(scheme: str, factory: StorageFactory, *, replace: bool = False) -> None:
    """Serve checkpoint locations of ``scheme`` (``vault://...``) with the storage ``factory`` builds.

    ``Accelerator(project_dir="vault://run")``, ``save_state``/``load_state`` with such a folder and the
    Trainer's ``output_dir`` then commit, find, read and rotate checkpoints through it. A package can
    register one without code run by the user: an entry point of the ``lockstep.storages`` group named
    after the scheme, read when lockstep first looks a location up.

    Args:
        scheme: the URL scheme, without ``://`` (``file`` replaces the storage of local paths).
        factory: called as ``factory(location, storage_options)`` for a location of ``scheme``; returns a
            :class:`~lockstep.checkpoint.storage.base.CheckpointStorage`.
        replace: replace the storage registered for ``scheme`` (else that is an error).

    Raises:
        ValueError: ``scheme`` is not a URL scheme, or is registered already (without ``replace``).
        TypeError: ``factory`` is not callable.

    Example:
        >>> from lockstep.checkpoint.storage import LocalStorage
        >>> register_storage("scratch", lambda location, options: LocalStorage())
        >>> type(storage_for("scratch://run")).__name__
        'LocalStorage'
        >>> unregister_storage("scratch")
    """
    if not isinstance(scheme, str) or not _SCHEME.match(scheme):
        raise ValueError(
            f"register_storage({scheme!r}, ...) takes a URL scheme: a letter, then letters, digits, '+', '-' or "
            "'.', without '://' (for example 'vault' for vault://bucket/run)."
        )
    if not callable(factory):
        raise TypeError(
            f"register_storage({scheme!r}, {factory!r}) takes a factory: a callable (such as a CheckpointStorage "
            "subclass) called as factory(location, storage_options), not a "
            f"{type(factory).__name__}."
        )
    scheme = scheme.lower()
    if scheme in _REGISTRY.factories and not replace:
        raise ValueError(
            f"A checkpoint storage is registered for {scheme}:// already ({_REGISTRY.factories[scheme]!r}); "
            "pass replace=True to replace it, or use another scheme."
        )
    _REGISTRY.factories[scheme] = factory


def unregister_storage(scheme: str) -> None:
    """Forget the storage registered for ``scheme`` (tests, notebooks); an unknown scheme is ignored.
    Locations of a built-in scheme are then served as they would be without it (``file``: not at all)."""
    _REGISTRY.factories.pop(str(scheme).lower(), None)


def registered_storages() -> list[str]:
    """The schemes with a registered storage (entry points included, loaded or not), sorted."""
    _discover()
    return sorted({*_REGISTRY.factories, *_REGISTRY.entry_points})


def storage_for(location: Location, storage_options: dict[str, Any] | None = None) -> CheckpointStorage:
    """The storage serving ``location``, chosen by its scheme (see the module's docstring).

    Raises:
        ValueError: no registered storage and no fsspec file system serves the scheme (naming the
            registered ones).
        ImportError: the fsspec file system of the scheme is not installed (naming the extra to install).
        TypeError: the registered factory did not build a ``CheckpointStorage``.
    """
    scheme = scheme_of(location)
    text = os.fspath(location)
    factory = _factory(scheme)
    if factory is None:
        raise ValueError(
            f"Checkpoint location {text!r} has the URL scheme {scheme}://, which no registered checkpoint storage "
            f"and no fsspec file system serves (registered: {', '.join(registered_storages()) or 'none'}; "
            "fsspec: fsspec.available_protocols()). Use a local path or a URL such as s3://bucket/run, install "
            f"the fsspec backend for {scheme}://, or register a storage: "
            f"lockstep.checkpoint.register_storage({scheme!r}, factory), or an entry point named {scheme!r} in "
            f"the {ENTRY_POINT_GROUP!r} group."
        )
    storage = factory(str(text), storage_options)
    if not isinstance(storage, CheckpointStorage):
        raise TypeError(
            f"The checkpoint storage registered for {scheme}:// ({factory!r}) built a {type(storage).__name__} "
            f"for {text!r}; it must return an instance of a lockstep.checkpoint.CheckpointStorage subclass."
        )
    return storage


def store_key(location: Location) -> str:
    """What a storage built for ``location`` can be reused for: its scheme and, for a URL, its bucket (or
    host): ``s3://bucket`` for ``s3://bucket/run/checkpoint_3``, ``file`` for any path."""
    scheme = scheme_of(location)
    if scheme == LOCAL_SCHEME:
        return LOCAL_SCHEME
    return "/".join(os.fspath(location).split("/", 3)[:3])


def _factory(scheme: str) -> StorageFactory | None:
    if scheme in _REGISTRY.factories:
        return _REGISTRY.factories[scheme]
    _discover()
    entry = _REGISTRY.entry_points.pop(scheme, None)
    if entry is not None:
        try:
            loaded = entry.load()
        except Exception as error:
            raise ImportError(
                f"The {ENTRY_POINT_GROUP!r} entry point {entry.name!r} ({entry.value}) serving {scheme}:// "
                f"checkpoint locations could not be loaded: {type(error).__name__}: {error}. Fix or uninstall the "
                "package that declares it."
            ) from error
        register_storage(scheme, loaded)
        return loaded
    if _served_by_fsspec(scheme):
        from lockstep.checkpoint.storage.fsspec_store import FsspecStorage

        return FsspecStorage
    return None


def _served_by_fsspec(scheme: str) -> bool:
    try:
        import fsspec
    except ImportError:  # fsspec comes with torch; without it no URL is served
        return False
    return scheme in fsspec.available_protocols()


def _discover() -> None:
    if _REGISTRY.discovered:
        return
    _REGISTRY.discovered = True
    from lockstep.entry_points import installed_entry_points

    for entry in installed_entry_points(ENTRY_POINT_GROUP):
        scheme = entry.name.lower()
        if scheme in _REGISTRY.factories or not _SCHEME.match(scheme):
            logger.warning(
                "Ignoring the %s entry point %r (%s): %s",
                ENTRY_POINT_GROUP,
                entry.name,
                entry.value,
                "its scheme has a storage registered already"
                if scheme in _REGISTRY.factories
                else "its name is not a URL scheme",
            )
            continue
        _REGISTRY.entry_points[scheme] = entry


def _local_storage(location: str, storage_options: dict[str, Any] | None) -> LocalStorage:
    """Local folders (``storage_options`` are for object stores: a local folder takes none)."""
    return LocalStorage()


register_storage(LOCAL_SCHEME, _local_storage)

__all__ = [
    "ENTRY_POINT_GROUP",
    "StorageFactory",
    "register_storage",
    "registered_storages",
    "scheme_of",
    "storage_for",
    "store_key",
    "unregister_storage",
]
