"""How the Accelerator answers the members of the parts it is composed of.

Each group of Accelerate's ``Accelerator`` members (process and rank, settings, the N-D mesh, trackers,
features not configured) is a small object of its own, built with exactly what it reads
(``ProcessView(state)``, ``MeshView(state, backend)``); the facade holds them and :func:`answers_for`
makes each public member of a part a member of the facade that forwards to it. The parts are not base
classes: they work on their own, and the facade's class lists which part answers what.

Example:
    >>> class Clock:
    ...     def __init__(self, hour: int) -> None:
    ...         self.hour = hour
    ...     @property
    ...     def noon(self) -> bool:
    ...         "Whether it is 12."
    ...         return self.hour == 12
    >>> @answers_for("_clock", Clock)
    ... class Host:
    ...     def __init__(self) -> None:
    ...         self._clock = Clock(12)
    >>> Host().noon, Host.noon.__doc__
    (True, 'Whether it is 12.')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

H = TypeVar("H", bound=type)


class _Forwarded:
    """A member of the host that reads and writes the same member of one of its parts."""

    def __init__(self, holder: str, name: str, member: Any) -> None:
        self.holder = holder
        self.name = name
        self.member = member
        self.__doc__ = getattr(member, "__doc__", None)

    def __get__(self, host: Any, owner: type | None = None) -> Any:
        if host is None:  # on the class: the part's own function or property (signatures, docs)
            return self.member
        return getattr(getattr(host, self.holder), self.name)

    def __set__(self, host: Any, value: Any) -> None:
        setattr(getattr(host, self.holder), self.name, value)


def answers_for(holder: str, part: type, *, internal: tuple[str, ...] = ()) -> Callable[[H], H]:
    """Class decorator: the host answers every public member of ``part`` from the part object it keeps in
    ``self.<holder>``; members the host defines itself stay its own, and ``internal`` names (what the host
    itself asks of the part) are not the host's."""

    def decorate(host: H) -> H:
        for name, member in vars(part).items():
            if name.startswith("_") or name in vars(host) or name in internal:
                continue
            setattr(host, name, _Forwarded(holder, name, member))
        return host

    return decorate
