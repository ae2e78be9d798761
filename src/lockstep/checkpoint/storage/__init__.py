"""Where checkpoints live: a local folder (atomic renames), any fsspec URL (uploads, manifest last), or a
storage registered for a URL scheme (:func:`register_storage`, or a ``lockstep.storages`` entry point).

Example:
    >>> from lockstep.checkpoint.storage import storage_for
    >>> type(storage_for("runs/a")).__name__
    'LocalStorage'
    >>> type(storage_for("memory://runs/a")).__name__  # doctest: +SKIP
    'FsspecStorage'
"""

from __future__ import annotations

from lockstep.checkpoint.storage.base import CheckpointStorage, Location
from lockstep.checkpoint.storage.local import LocalStorage
from lockstep.checkpoint.storage.registry import (
    ENTRY_POINT_GROUP,
    StorageFactory,
    register_storage,
    registered_storages,
    scheme_of,
    storage_for,
    store_key,
    unregister_storage,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "CheckpointStorage",
    "LocalStorage",
    "Location",
    "StorageFactory",
    "register_storage",
    "registered_storages",
    "scheme_of",
    "storage_for",
    "store_key",
    "unregister_storage",
]
