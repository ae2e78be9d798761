"""Two processes save checkpoint_0 to an object store, then checkpoint_1 in the background
(``async_save=True``); rank 1 dies by SIGKILL inside its upload, before any of its files arrives.

Usage: upload_and_die_on_rank_1.py URL, started once per rank with torchrun's variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; the S3 endpoint and credentials in the AWS_* variables), without a launcher that
would stop rank 0 when rank 1 dies.

Rank 0 outlives rank 1: its upload returns once rank 1 is gone (a collective that rank 1 never joins fails
when its connections close), and its background writer then looks for every rank's ``.rank_{r}.done``
marker once (no waiting: the marker of a rank that finished its upload is there by then). So the markers
rank 0 sees are exactly what rank 1 wrote before it died. Rank 0 prints one line, the outcome of its
background save (``committed``, or the error ``wait_for_checkpoint()`` raised), and exits.
"""

import os
import signal
import sys

import torch
import torch.distributed as dist

from lockstep import Accelerator, ProjectConfiguration
from lockstep.checkpoint import collective_save

url = sys.argv[1]
torch.set_num_threads(1)
accelerator = Accelerator(
    project_config=ProjectConfiguration(project_dir=url, automatic_checkpoint_naming=True)
)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, optimizer = accelerator.prepare(model, optimizer)
accelerator.backward(model(torch.ones(3, 4)).sum())
optimizer.step()
accelerator.save_state()  # checkpoint_0, complete

filesystem = accelerator._saving.manager.storage(url).fs
upload = filesystem.put


def die_before_the_first_file(local_paths, remote_paths, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def upload_then_outlive_rank_1(local_paths, remote_paths, **kwargs):
    upload(local_paths, remote_paths, **kwargs)
    try:
        dist.barrier()  # rank 1 never joins: this fails once it is dead
    except RuntimeError:
        pass
    else:
        sys.exit("unreachable: rank 1 joined a barrier instead of dying in its upload")


if accelerator.process_index == 1:
    filesystem.put = die_before_the_first_file
else:
    filesystem.put = upload_then_outlive_rank_1
    collective_save.ASYNC_TIMEOUT_SECONDS = 0.0  # look for the markers once, after rank 1 died
with torch.no_grad():
    accelerator.unwrap_model(model).weight.add_(1.0)
accelerator.save_state(async_save=True)  # checkpoint_1
try:
    accelerator.wait_for_checkpoint()
    outcome = "committed"
except Exception as error:
    outcome = f"{type(error).__name__}: {error}"
if accelerator.process_index == 1:
    sys.exit("unreachable: rank 1 should have died in its upload")
print(outcome, flush=True)
os._exit(0)  # the process group has lost rank 1: nothing to shut down
