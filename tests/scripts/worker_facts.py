"""Reports how this worker process was started, for tests/launcher/test_preloaded_workers.py.

Usage: worker_facts.py OUT_DIR. Rank r prints `FACTS {...}` without flushing: whether torch was imported
before this script ran (it imports torch itself afterwards), whether the worker leads a session of its own.
Then it waits for OUT_DIR/go, leaving a non-daemon thread that writes OUT_DIR/thread_r after a short sleep
and an exit handler that writes OUT_DIR/atexit_r saying whether that thread had finished first.
"""

import atexit
import json
import os
import random
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
    "python_random": random.random(),
}
print("FACTS " + json.dumps(facts))  # no flush: a worker's output is unbuffered, as under `python -u`

import numpy  # noqa: E402
import torch  # noqa: E402  (a script importing torch at its top level is one the launcher preloads for)

print("NUMPY " + json.dumps({"rank": int(rank), "draw": float(numpy.random.random())}))  # no flush either

assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"]), "the launch's thread count is kept"


def late_write() -> None:
    time.sleep(0.5)
    (out / f"thread_{rank}").write_text("done")


def at_exit() -> None:
    (out / f"atexit_{rank}").write_text(str((out / f"thread_{rank}").exists()))


atexit.register(at_exit)
threading.Thread(target=late_write, daemon=False).start()
deadline = time.monotonic() + 300  # longer than the test waits for the FACTS lines
while not (out / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
