"""Kill -9 a process during the background fsync of a ``save_state(durable="background")`` at seeded random
moments after the call returned; after each kill, the newest valid checkpoint must load and be the new one
complete or the previous (the folder is final at return, so it is the new one).

Usage: kill_background_commit.py PROJECT_DIR KILLS SEED. Prints one JSON line: the outcome of every kill.

Each kill is a forked child that saves checkpoint_1 and is killed by a timer thread ``delay`` seconds after
``save_state`` returned, the delays drawn uniformly over 1.5 times the commit's measured length (so that
moments during and after the fsync are all drawn).
"""

import json
import os
import random
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from tests.helpers.deadlines import scaled
from tests.helpers.forking import fork

from lockstep import Accelerator, ProjectConfiguration
from lockstep.checkpoint import CheckpointError, layout, load_model_files

torch.set_num_threads(1)  # an OpenMP pool in use at fork() deadlocks the child (libgomp is not fork-safe)

project_dir, kills, seed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
root = project_dir / "checkpoints"
accelerator = Accelerator(
    project_config=ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True)
)
torch.manual_seed(0)
model = torch.nn.Linear(256, 256)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, optimizer = accelerator.prepare(model, optimizer)
accelerator.backward(model(torch.ones(3, 256)).sum())
optimizer.step()
accelerator.save_state()  # checkpoint_0, committed
previous = model.weight.detach().clone()
with torch.no_grad():
    model.weight.add_(1.0)


def clear_second() -> None:
    shutil.rmtree(root / "checkpoint_1", ignore_errors=True)
    shutil.rmtree(root / layout.STAGING_PARENT, ignore_errors=True)


def commit_seconds() -> float:
    """The length of one background fsync here (the writer thread's time)."""
    started = time.perf_counter()
    accelerator.save_state(durable="background")
    returned = time.perf_counter()
    accelerator.wait_for_checkpoint()
    accelerator.project_configuration.iteration = 1
    clear_second()
    return max(time.perf_counter() - returned, (returned - started) * 0.1)


def killed_child(delay: float) -> None:
    pid = fork()  # refused while a thread runs here (the previous save's writer must have ended)
    if pid == 0:  # the child: save, and be killed `delay` seconds after the call returned
        accelerator.save_state(durable="background")
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        time.sleep(60)
        os._exit(3)
    limit = scaled(30)
    deadline = time.monotonic() + limit
    while (waited := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:  # a hung child fails the run instead of hanging it
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise SystemExit(
                f"the child saving checkpoint_1 hung (killed after {limit:.0f} s; delay {delay})"
            )
        time.sleep(0.005)
    status = waited[1]
    if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        raise SystemExit(f"the child was not killed by its timer: status {status}")


def outcome() -> str:
    """Which checkpoint the newest valid one is, checked against the weights each must hold."""
    try:
        newest = layout.newest_valid_checkpoint(root)
    except (FileNotFoundError, CheckpointError) as error:
        return f"no valid checkpoint: {error}"
    weight = load_model_files(newest)["weight"]
    expected = {"checkpoint_0": previous, "checkpoint_1": model.weight.detach()}
    if newest.name not in expected or not torch.equal(weight, expected[newest.name]):
        return f"{newest.name} holds the wrong weights"
    return "new" if newest.name == "checkpoint_1" else "previous"


length = commit_seconds()
draw = random.Random(seed)
outcomes = []
for _ in range(kills):
    delay = draw.uniform(0.0, 1.5 * length)
    killed_child(delay)
    outcomes.append({"delay": round(delay, 5), "outcome": outcome()})
    clear_second()
print(json.dumps({"commit_seconds": round(length, 5), "kills": outcomes}))
