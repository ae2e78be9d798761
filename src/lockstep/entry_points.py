"""What installed packages add to lockstep: one reading of the installed entry points, shared by every kind.

Each kind of extension has a ``register_<kind>`` function for code and an entry-point group for an installed
package, read on the kind's first use (never when lockstep is imported):

- ``lockstep.backends``: a ``BackendSpec``, or a callable or iterable giving them (``register_backend_spec``);
- ``lockstep.layers``: a ``LayerSpec``, or a callable or iterable giving them (``register_layer``);
- ``lockstep.cluster_environments``: a ``Cluster`` subclass (``register_cluster_environment``);
- ``lockstep.storages``: a storage factory, the entry point's name the URL scheme (``register_storage``);
- ``lockstep.trackers``: a ``GeneralTracker`` subclass (``register_tracker_class``).

Backends, layers, setting groups and cluster environments keep their table in a :class:`Registry` (one
shape: ``register``, ``unregister``, discovery on first use); storages are looked up by URL scheme and load
their entry point only when a location of that scheme is asked for, and trackers keep Accelerate's table
(``LOGGER_TYPE_TO_CLASS``, a repeated name replaced with a warning), so those two keep their own.

Reading the installed distributions costs tens of milliseconds, so it is done once per ``sys.path`` for all
groups together (a folder put on ``sys.path`` later, as a notebook or a test does, is read then). A
distribution whose metadata cannot be read is logged and skipped: a broken install elsewhere must not stop a
training run.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Generic, TypeVar

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


@dataclass
class Registry(Generic[T]):
    """The table of one kind of extension: what ``register_<kind>`` adds to, with discovery on first use.

    On the first :meth:`entries`, ``built_ins()`` runs (each built-in registers itself, usually by being
    imported) and then the entry points of ``group`` are read and registered. Registering the object that is
    registered already under its name does nothing (a module that registers itself on import may also be
    what its entry point names).

    Example:
        >>> table = Registry(noun="word", function="register_word", kind=str, name_of=str.lower, order=str.lower)
        >>> table.register("Two"), table.register("one", replace=True), table.entries()
        ('Two', 'one', ['one', 'Two'])
        >>> table.register("TWO")
        Traceback (most recent call last):
        ...
        ValueError: A word named 'two' is registered already; pick another name, or pass replace=True.
    """

    noun: str
    """What one entry is called in messages (``layer``, ``cluster environment``)."""
    function: str
    """The public function that registers this kind (``register_layer``), for error messages."""
    kind: type
    """What is registered: an instance (``LayerSpec``), or a subclass when ``subclasses``."""
    name_of: Callable[[Any], str]
    """The name an entry is registered under (unique in the table)."""
    order: Callable[[Any], Any]
    """The sort key of :meth:`entries` (the order entries are asked in)."""
    group: str | None = None
    """The entry-point group installed packages declare this kind in, read on first use."""
    built_ins: Callable[[], None] | None = None
    """Registers the built-in entries (run once, on first use, before the entry points)."""
    check: Callable[[Any, list[Any]], None] | None = None
    """Further checks of a new entry against the others registered (raises ``ValueError``)."""
    subclasses: bool = False
    """Entries are classes, subclasses of ``kind`` (cluster environments), not instances."""
    table: dict[str, Any] = field(default_factory=dict)
    discovered: bool = False

    def register(self, entry: T, *, replace: bool = False) -> T:
        """Add ``entry`` under its name; ``replace`` replaces an entry of that name (else that is an error).

        Raises:
            TypeError: ``entry`` is not of this table's kind.
            ValueError: its name is taken (without ``replace``), or ``check`` refuses it.
        """
        if not (self._is_subclass(entry) if self.subclasses else isinstance(entry, self.kind)):
            shown = getattr(entry, "__name__", None) or repr(entry)
            wanted = (
                f"a subclass of {self.kind.__name__} (the class, not an instance)" if self.subclasses else ""
            )
            raise TypeError(
                f"{self.function}({shown}) is invalid: it takes {wanted or f'a {self.kind.__name__}'}."
            )
        name = self.name_of(entry)
        taken = self.table.get(name)
        if taken is entry:
            return entry
        if taken is not None and not replace:
            raise ValueError(
                f"A {self.noun} named {name!r} is registered already{_shown(taken)}; pick another name, or pass "
                "replace=True."
            )
        if self.check is not None:
            self.check(entry, [other for key, other in self.table.items() if key != name])
        self.table[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Remove the entry registered under ``name`` (tests, notebooks that redefine one); unknown names are
        ignored."""
        self.table.pop(name, None)

    def entries(self) -> list[T]:
        """Every registered entry, sorted by ``order`` (built-ins and entry points registered on first use)."""
        if not self.discovered:
            self.discovered = True
            if self.built_ins is not None:
                self.built_ins()
            if self.group is not None:
                for entry in loaded_specs(self.group, type if self.subclasses else self.kind):
                    self.register(entry)
        return sorted(self.table.values(), key=self.order)

    def _is_subclass(self, entry: Any) -> bool:
        return isinstance(entry, type) and issubclass(entry, self.kind)


def _shown(entry: Any) -> str:
    """`` (module.Class)`` for a registered class, which its name alone does not locate; else nothing."""
    return f" ({entry.__module__}.{entry.__qualname__})" if isinstance(entry, type) else ""


__all__ = ["Registry", "installed_entry_points", "loaded_specs"]
