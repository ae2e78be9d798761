"""The Trainer's checkpoint folders: ``output_dir/checkpoint-<step>``, rotation and the newest valid one."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

from lockstep.checkpoint import CheckpointError, verify

PREFIX = "checkpoint"
_NAME = re.compile(rf"^{PREFIX}-(\d+)$")
logger = logging.getLogger("lockstep.trainer")


def checkpoint_folder(output_dir: str, global_step: int) -> Path:
    return Path(output_dir) / f"{PREFIX}-{global_step}"


def sorted_checkpoints(output_dir: str) -> list[Path]:
    """``checkpoint-<step>`` folders of ``output_dir``, oldest (smallest step) first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return [path for _, path in sorted(found)]


def newest_valid_checkpoint(output_dir: str) -> Path | None:
    """The newest checkpoint whose manifest and files verify (broken newer ones are skipped and logged)."""
    for folder in reversed(sorted_checkpoints(output_dir)):
        try:
            verify(folder)
        except CheckpointError as error:
            logger.warning("Skipping %s, which cannot be loaded: %s", folder, error)
            continue
        return folder
    return None


def rotate_checkpoints(
    output_dir: str, limit: int | None, keep: Path, *, protected: Path | None = None
) -> list[Path]:
    """Delete the oldest checkpoints beyond ``limit``; never ``keep`` (the newest) nor ``protected`` (the
    best model's), so with both distinct at least two remain. Returns what was deleted."""
    if limit is None:
        return []
    kept = {keep} | ({protected} if protected is not None else set())
    folders = [f for f in sorted_checkpoints(output_dir) if f not in kept]
    doomed = folders[: max(0, len(folders) + len(kept) - max(limit, len(kept)))]
    for folder in doomed:
        shutil.rmtree(folder, ignore_errors=True)
    return doomed


def keep_only(output_dir: str, keep: Path) -> list[Path]:
    """Delete every checkpoint of ``output_dir`` but ``keep``; returns what was deleted."""
    doomed = [folder for folder in sorted_checkpoints(output_dir) if folder != keep]
    for folder in doomed:
        shutil.rmtree(folder, ignore_errors=True)
    return doomed
