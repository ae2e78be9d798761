"""A 2-process loop that hangs on purpose, for the hang-diagnosis tests.

Usage: hang_worker.py MODE PROJECT_DIR, with MODE one of
  skip        rank 1 skips the all_reduce of step 5, so rank 0 ends up alone in an all_reduce;
  sleep       rank 1 sleeps forever in step 5;
  pg-timeout  like sleep, with InitProcessGroupKwargs(timeout=10 s) and the watchdog at its default;
  ddp-timeout a DDP model with a 10 s process-group timeout; rank 1 sleeps before step 6's forward, so
              rank 0 times out in DDP's gradient all-reduce (issued by torch, not recorded);
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
timeout = mode in ("pg-timeout", "ddp-timeout")
handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=10))] if timeout else []
accelerator = Accelerator(project_dir=project_dir, kwargs_handlers=handlers)
rank = accelerator.process_index
model = torch.nn.Linear(3, 1)
if mode == "ddp-timeout":  # a DDP model: backward all-reduces gradients from torch's C++
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
else:
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
total = torch.zeros(2)
for step in range(8):
    if mode == "ddp-timeout" and rank == 1 and step == 6:
        time.sleep(3600)
    loss = model(torch.ones(2, 3)).sum()
    accelerator.backward(loss)  # BACKWARD_HERE
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
