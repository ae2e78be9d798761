"""Save checkpoint_0 to an object store cleanly, then die by SIGKILL in the middle of the second upload.

Usage: upload_and_die.py URL (the S3 endpoint and credentials come from the AWS_* environment variables).
After the first file of checkpoint_1 is uploaded, the process kills itself: the others and the manifest
never arrive.
"""

import os
import signal
import sys

import torch

from lockstep import Accelerator, ProjectConfiguration

url = sys.argv[1]
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


def put_one_then_die(local_paths, remote_paths, **kwargs):
    upload(local_paths[:1], remote_paths[:1], **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)


filesystem.put = put_one_then_die
with torch.no_grad():
    model.weight.add_(1.0)
accelerator.save_state()  # checkpoint_1: killed mid-upload
sys.exit("unreachable: the second save should have killed the process")
