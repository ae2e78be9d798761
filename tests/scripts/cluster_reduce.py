"""Report this worker's place in the job and the sum of an all_reduce (the simulated-cluster tests)."""

import json
import os
import sys

import torch

from lockstep import Accelerator

accelerator = Accelerator()
total = accelerator.reduce(torch.tensor([float(accelerator.process_index + 1)]), reduction="sum")
report = {
    "rank": accelerator.process_index,
    "world": accelerator.num_processes,
    "machine": int(os.environ["GROUP_RANK"]),
    "sum": total.item(),
    "threads": os.environ.get("OMP_NUM_THREADS"),
}
sys.stdout.write("REPORT " + json.dumps(report) + "\n")  # one write: ranks share the pipe
sys.stdout.flush()
accelerator.end_training()
