"""The Trainer's checkpoint folders: ``output_dir/checkpoint-<step>``, rotation and the newest valid one.

``output_dir`` is a local folder or any fsspec URL (``s3://bucket/run``): folders are ``Path`` objects for
the first and URL strings for the second (see :mod:`lockstep.checkpoint.storage`).
"""

from __future__ import annotations

import logging
import re

from lockstep.checkpoint import CheckpointError, Location, storage_for

PREFIX = "checkpoint"
_NAME = re.compile(rf"^{PREFIX}-(\d+)$")
logger = logging.getLogger("lockstep.trainer")


def checkpoint_folder(output_dir: str, global_step: int) -> Location:
    return storage_for(output_dir).join(output_dir, f"{PREFIX}-{global_step}")


def sorted_checkpoints(output_dir: str) -> list[Location]:
    """``checkpoint-<step>`` folders of ``output_dir``, oldest (smallest step) first."""
    storage = storage_for(output_dir)
    found = [(_NAME.match(storage.name(folder)), folder) for folder in storage.children(output_dir)]
    return [folder for _, folder in sorted((int(m.group(1)), folder) for m, folder in found if m)]


def newest_valid_checkpoint(output_dir: str) -> Location | None:
    """The newest checkpoint whose manifest and files verify (broken newer ones are skipped and logged)."""
    storage = storage_for(output_dir)
    for folder in reversed(sorted_checkpoints(output_dir)):
        try:
            storage.check(folder, accelerate_layout=False)  # a Trainer checkpoint has its manifest
        except CheckpointError as error:
            logger.warning("Skipping %s, which cannot be loaded: %s", folder, error)
            continue
        return folder
    return None


def rotate_checkpoints(
    output_dir: str, limit: int | None, keep: Location, *, protected: Location | None = None
) -> list[Location]:
    """Delete the oldest checkpoints beyond ``limit``; never ``keep`` (the newest) nor ``protected`` (the
    best model's), so with both distinct at least two remain. Returns what was deleted."""
    if limit is None:
        return []
    kept = {str(keep)} | ({str(protected)} if protected is not None else set())
    folders = [f for f in sorted_checkpoints(output_dir) if str(f) not in kept]
    doomed = folders[: max(0, len(folders) + len(kept) - max(limit, len(kept)))]
    storage = storage_for(output_dir)
    for folder in doomed:
        storage.remove(folder)
    return doomed


def keep_only(output_dir: str, keep: Location) -> list[Location]:
    """Delete every checkpoint of ``output_dir`` but ``keep``; returns what was deleted."""
    doomed = [folder for folder in sorted_checkpoints(output_dir) if str(folder) != str(keep)]
    storage = storage_for(output_dir)
    for folder in doomed:
        storage.remove(folder)
    return doomed
