"""What installed packages add to lockstep: one reading of the installed entry points, shared by every kind.

Each kind of extension has a ``register_<kind>`` function for code and an entry-point group for an installed
package, read on the kind's first use (never when lockstep is imported):

- ``lockstep.backends``: a ``BackendSpec``, or a callable or iterable giving them (``register_backend_spec``);
- ``lockstep.layers``: a ``LayerSpec``, or a callable or iterable giving them (``register_layer``);
- ``lockstep.cluster_environments``: a ``Cluster`` subclass (``register_cluster_environment``);
- ``lockstep.storages``: a storage factory, the entry point's name the URL scheme (``register_storage``);
- ``lockstep.trackers``: a ``GeneralTracker`` subclass (``register_tracker_class``).

Reading the installed distributions costs tens of milliseconds, so it is done once per ``sys.path`` for all
groups together (a folder put on ``sys.path`` later, as a notebook or a test does, is read then). A
distribution whose metadata cannot be read is logged and skipped: a broken install elsewhere must not stop a
training run.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from importlib import metadata
from typing import Any, TypeVar

T = TypeVar("T")

logger = logging.getLogger("lockstep")

_read: tuple[tuple[str, ...], dict[str, list[metadata.EntryPoint]]] | None = None


def installed_entry_points(group: str) -> list[metadata.EntryPoint]:
    """The entry points installed packages declare in ``group``, in the order the distributions are found.

    Example:
        >>> installed_entry_points("lockstep.no_such_group")
        []
    """
    return list(_by_group().get(group, ()))


def _by_group() -> dict[str, list[metadata.EntryPoint]]:
    global _read
    path = tuple(sys.path)
    if _read is not None and _read[0] == path:
        return _read[1]
    groups: dict[str, list[metadata.EntryPoint]] = {}
    try:
        installed = metadata.entry_points()  # one reading (``group=`` would read them all again per group)
        found = [
            entry
            for group in sorted(installed.groups)
            if group.startswith("lockstep.")
            for entry in installed.select(group=group)
        ]
    except Exception as error:  # a broken installed distribution must not stop lockstep
        logger.warning("Could not read the installed packages' lockstep entry points: %s", error)
        found = []
    for entry in found:
        groups.setdefault(entry.group, []).append(entry)
    _read = (path, groups)
    return groups


def loaded_specs(group: str, kind: type[T]) -> list[T]:
    """The ``kind`` objects the entry points of ``group`` give: each entry point names an object of ``kind``, an
    iterable of them, a callable returning either, or a module that registers its own on import (giving none
    here).

    Example:
        >>> loaded_specs("lockstep.no_such_group", int)
        []
    """
    found: list[T] = []
    for entry in installed_entry_points(group):
        loaded: Any = entry.load()
        if callable(loaded) and not isinstance(loaded, type):
            loaded = loaded()
        if isinstance(loaded, kind):
            found.append(loaded)
        elif isinstance(loaded, Iterable) and not isinstance(loaded, str | bytes):
            found.extend(item for item in loaded if isinstance(item, kind))
    return found


__all__ = ["installed_entry_points", "loaded_specs"]
