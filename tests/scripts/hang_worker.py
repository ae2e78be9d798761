"""A 2-process loop that hangs on purpose, for the hang-diagnosis tests.

Usage: hang_worker.py MODE PROJECT_DIR, with MODE one of
  skip        rank 1 skips the all_reduce of step 5, so rank 0 ends up alone in an all_reduce;
  sleep       rank 1 sleeps forever in step 5;
  pg-timeout  like sleep, with InitProcessGroupKwargs(timeout=10 s) and the watchdog at its default;
  debug       rank 1 calls lockstep's reduce with a different shape in step 5 (run with LOCKSTEP_DEBUG=1);
  clean       no hang.
Each rank prints "STEP <rank> <step> <epoch seconds>" after its optimizer steps.
"""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from lockstep import Accelerator, InitProcessGroupKwargs

mode, project_dir = sys.argv[1], sys.argv[2]
handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=10))] if mode == "pg-timeout" else []
accelerator = Accelerator(project_dir=project_dir, kwargs_handlers=handlers)
rank = accelerator.process_index
weight = torch.nn.Parameter(torch.ones(3))
optimizer = accelerator.prepare(torch.optim.SGD([weight], lr=0.1))
total = torch.zeros(2)
for step in range(8):
    loss = (weight * 2).sum()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    sys.stdout.write(f"STEP {rank} {step} {time.time():.3f}\n")  # one write: lines of both ranks stay whole
    sys.stdout.flush()
    if rank == 1 and step == 5:
        if mode == "skip":
            continue  # the skipped all_reduce
        if mode in ("sleep", "pg-timeout"):
            time.sleep(3600)  # SLEEPS_HERE
        if mode == "debug":
            accelerator.reduce(torch.zeros(5))  # MISMATCHED_REDUCE
    if mode == "debug" and step == 5 and rank == 0:
        accelerator.reduce(torch.zeros(2))  # MATCHING_REDUCE
    dist.all_reduce(total)  # ALL_REDUCE_HERE
accelerator.wait_for_everyone()  # BARRIER_HERE
accelerator.end_training()
