"""Where checkpoints live: a local folder (atomic renames) or any fsspec URL (uploads, manifest last).

Example:
    >>> from lockstep.checkpoint.storage import storage_for
    >>> type(storage_for("runs/a")).__name__
    'LocalStorage'
    >>> type(storage_for("memory://runs/a")).__name__  # doctest: +SKIP
    'FsspecStorage'
"""

from __future__ import annotations

import os
import re
from typing import Any

from lockstep.checkpoint.storage.base import CheckpointStorage, Location
from lockstep.checkpoint.storage.local import LocalStorage

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(location: Location | None) -> bool:
    """Whether ``location`` is a URL that needs fsspec (``file://`` stays a local folder)."""
    if location is None:
        return False
    text = os.fspath(location)
    return isinstance(text, str) and bool(_URL.match(text)) and not text.startswith("file://")


def storage_for(location: Location, storage_options: dict[str, Any] | None = None) -> CheckpointStorage:
    """The storage serving ``location``: local folders (and ``file://``) or an fsspec file system."""
    if not is_url(location):
        return LocalStorage()
    from lockstep.checkpoint.storage.fsspec_store import FsspecStorage

    return FsspecStorage(os.fspath(location), storage_options)


__all__ = ["CheckpointStorage", "LocalStorage", "Location", "is_url", "storage_for"]
