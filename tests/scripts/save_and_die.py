"""Save checkpoint_0 cleanly, then die by SIGKILL at a chosen point of the second save.

Usage: save_and_die.py PROJECT_DIR POINT, with POINT one of: staging, shared, manifest, commit, pointer.
"""

import os
import signal
import sys

import torch

import lockstep.checkpoint.layout as layout
import lockstep.checkpoint.training_state as files
from lockstep import Accelerator, ProjectConfiguration

project_dir, point = sys.argv[1], sys.argv[2]
accelerator = Accelerator(
    project_config=ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True)
)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, optimizer = accelerator.prepare(model, optimizer)
accelerator.backward(model(torch.ones(3, 4)).sum())
optimizer.step()
accelerator.save_state()  # checkpoint_0, complete


def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def die_after(function):
    def wrapper(*args, **kwargs):
        function(*args, **kwargs)
        die()

    return wrapper


with torch.no_grad():
    model.weight.add_(1.0)
if point == "staging":
    layout.prepare_staging = die_after(layout.prepare_staging)
elif point == "shared":
    files.save_model_files = die_after(files.save_model_files)  # dies after the weights, before the rest
elif point == "manifest":
    layout.write_manifest = die_after(layout.write_manifest)
elif point == "commit":
    original_replace = os.replace

    def replace_then_die(source, target):
        original_replace(source, target)
        if str(target).endswith("checkpoint_1"):
            die()

    os.replace = replace_then_die
accelerator.save_state(durable="sync")  # checkpoint_1: the protocol that commits before returning
print("unreachable")
