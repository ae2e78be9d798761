"""Reports how this worker process was started, for tests/launcher/test_preloaded_workers.py.

Usage: worker_facts.py OUT_DIR. Rank r prints `FACTS {...}` (whether torch was imported before this script
ran, whether the worker leads a session of its own) without flushing, then waits for OUT_DIR/go; it leaves a
non-daemon thread that writes OUT_DIR/thread_r after a short sleep and an exit handler that writes
OUT_DIR/atexit_r saying whether that thread had finished first.
"""

import atexit
import json
import os
import sys
import threading
import time
from pathlib import Path

out = Path(sys.argv[1])
rank = os.environ["RANK"]
facts = {
    "rank": int(rank),
    "torch_preloaded": "torch" in sys.modules,
    "session_leader": os.getsid(0) == os.getpid(),
    "argv": sys.argv[1:],
    "main": __name__,
}
print("FACTS " + json.dumps(facts))  # no flush: a worker's output is unbuffered, as under `python -u`


def late_write() -> None:
    time.sleep(0.5)
    (out / f"thread_{rank}").write_text("done")


def at_exit() -> None:
    (out / f"atexit_{rank}").write_text(str((out / f"thread_{rank}").exists()))


atexit.register(at_exit)
threading.Thread(target=late_write, daemon=False).start()
deadline = time.monotonic() + 60
while not (out / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
