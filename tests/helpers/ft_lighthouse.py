"""A torchft lighthouse in a process of its own, for tests that kill it (shutting down an in-process
``LighthouseServer`` leaves it answering: a group committed 30 more steps after ``shutdown()``)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def lighthouse_process(min_replicas: int, **timing: int) -> Iterator[tuple[subprocess.Popen, str]]:
    """Yields the lighthouse's process and address; kills it on the way out."""
    options = ", ".join(f"{key}={value}" for key, value in {"min_replicas": min_replicas, **timing}.items())
    code = (
        "import time; from torchft.coordination import LighthouseServer; "
        f"server = LighthouseServer(bind='127.0.0.1:0', {options}); print(server.address(), flush=True); "
        "time.sleep(600)"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert process.stdout is not None
        yield process, process.stdout.readline().strip()
    finally:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()
