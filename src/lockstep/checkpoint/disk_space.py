"""Saves that run out of disk space: recognised, reported as one :class:`CheckpointError`, cleaned up.

A writer that meets a full disk does not always say so. ``open().write`` raises ``OSError(ENOSPC)``,
safetensors a ``SafetensorError`` naming ``os error 28``, but ``torch.save`` raises a ``RuntimeError`` from
its zip writer (``unexpected pos 576 vs 534``) with no errno at all. So a failed write counts as a full
disk when ENOSPC or EDQUOT is anywhere in its chain of errors, or when the disk it wrote to has less free
space left than the rest of the save needs (or less than :data:`LOW_SPACE_BYTES`): on a disk with room
left, ``torch.save`` failing is some other error and is raised as itself.

The error names the checkpoint, the bytes the save needs (the tensors of this process's snapshot: the
files add a few KiB of headers), the bytes written when it failed and the space left on that disk.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from lockstep.errors import CheckpointError

LOW_SPACE_BYTES = 1 << 20
"""A write that fails with less free space than this on its disk failed because the disk is full."""

_OUT_OF_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_OUT_OF_SPACE_TEXTS = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")


def human_bytes(count: int) -> str:
    """``1,234,567 bytes (1.2 MiB)``."""
    size, unit = float(count), "bytes"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    short = f"{count} bytes" if unit == "bytes" else f"{size:.1f} {unit}"
    return f"{count:,} bytes" if unit == "bytes" else f"{count:,} bytes ({short})"


def folder_bytes(folder: Path) -> int:
    """The bytes of every file under ``folder`` (0 when it is gone)."""
    total = 0
    for path in folder.rglob("*") if folder.is_dir() else ():
        try:
            total += path.stat().st_size if path.is_file() else 0
        except OSError:  # removed meanwhile
            pass
    return total


def free_bytes(path: Path) -> tuple[int, int, Path]:
    """(free, total, mount point) of the disk holding ``path`` (or its nearest existing parent)."""
    existing = next(folder for folder in (path, *path.parents) if folder.exists())  # "/" always exists
    usage = shutil.disk_usage(existing)
    mount = next(folder for folder in (existing, *existing.parents) if os.path.ismount(folder))
    return usage.free, usage.total, mount


def _chain(error: BaseException) -> list[BaseException]:
    found: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in found:
        found.append(current)
        current = current.__cause__ or current.__context__
    return found


def says_out_of_space(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from) is ENOSPC or EDQUOT, as an errno or in its text."""
    for link in _chain(error):
        if isinstance(link, OSError) and link.errno in _OUT_OF_SPACE_ERRNOS:
            return True
        if any(text in str(link) for text in _OUT_OF_SPACE_TEXTS):
            return True
    return False


def _needs(needed: int, written: int) -> str:
    if needed > written:
        return (
            f"The save needs about {human_bytes(needed)} for this process's tensors; {human_bytes(written)} "
            "had been written when the write failed"
        )
    # the estimate (tensors only) fell short: a sharding backend's shards, or many small files
    return f"The save needs more than the {human_bytes(written)} it had written when the write failed"


def out_of_space_error(
    error: BaseException, *, checkpoint: object, staging: Path, needed: int, process: str = ""
) -> CheckpointError | None:
    """The :class:`CheckpointError` to raise instead of ``error`` when a save into ``staging`` failed
    because its disk is full; None when it failed for another reason (or already is that error).

    Args:
        error: what the writer raised.
        checkpoint: the checkpoint's final folder (or URL), named in the message.
        staging: the folder the save was writing.
        needed: the bytes this process's part of the save needs (estimated from its tensors).
        process: ``"process 1 of 2"`` on several processes, named in the message.
    """
    if isinstance(error, CheckpointError):
        return None
    written = folder_bytes(staging)
    free, total, mount = free_bytes(staging)
    if not says_out_of_space(error) and free >= max(needed - written, LOW_SPACE_BYTES):
        return None
    who = f" ({process})" if process else ""
    failure = CheckpointError(
        f"Saving the checkpoint {checkpoint}{who} ran out of disk space ({type(error).__name__}: {error}). "
        f"{_needs(needed, written)}, and {human_bytes(free)} were left free of "
        f"{human_bytes(total)} on the disk mounted at {mount}. The partial save is removed and the previous "
        "checkpoint stays the newest valid one (a resume loads it). Free space on that disk, keep fewer "
        "checkpoints (ProjectConfiguration(total_limit=...) or TrainingArguments(save_total_limit=...)), "
        "or save to a larger disk."
    )
    failure.__cause__ = error
    return failure
