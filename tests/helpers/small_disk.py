"""A real, size-limited disk for the tests of what a save does when the disk fills: a tmpfs mounted on a
test's folder (``mount -t tmpfs -o size=...``; the test machines run as root).

Where mounting is not permitted the test skips, saying why; under CI (``CI=true``) it fails instead: a
disk-full test that silently skips in CI checks nothing.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.reference import in_ci


def _unavailable(reason: str) -> None:
    message = f"no size-limited disk for this test: {reason}"
    if in_ci():
        pytest.fail(f"CI=true: {message}", pytrace=False)
    pytest.skip(message)


@contextlib.contextmanager
def small_disk(folder: Path, size_bytes: int) -> Iterator[Path]:
    """``folder``, holding a fresh tmpfs of ``size_bytes`` (a multiple of 4 KiB) until the context ends."""
    if shutil.which("mount") is None:
        _unavailable("the mount command is not installed")
    folder.mkdir(parents=True, exist_ok=True)
    command = ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(folder)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        _unavailable(f"`{' '.join(command)}` exited {done.returncode}: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        # lazy: a file a failed writer still holds open must not keep the mount (and the test) alive
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30, check=True)
