"""Report this process's place as lockstep read it, and the sum of an all_reduce (a process started by a
cluster environment itself, with no launcher: ``srun python``, ``mpirun python``)."""

import json
import sys

import torch

from lockstep import Accelerator
from lockstep._env import read_cluster_environment

accelerator = Accelerator(cpu=True)
place = read_cluster_environment()
total = accelerator.reduce(torch.tensor([float(accelerator.process_index + 1)]), reduction="sum")
report = {
    "source": place.source,
    "rank": accelerator.process_index,
    "world": accelerator.num_processes,
    "local_world": place.local_world_size,
    "sum": total.item(),
}
sys.stdout.write("REPORT " + json.dumps(report) + "\n")  # one write: ranks share the pipe
sys.stdout.flush()
accelerator.end_training()
