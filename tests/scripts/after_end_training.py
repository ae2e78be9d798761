"""Work after ``end_training()``, as transformers' no-trainer examples do: synchronise, then save on the main
process; the process group (lockstep's, or one the script made itself with LOCKSTEP_TEST_OWN_GROUP=1) is torn
down at exit."""

import os
import sys

import torch
import torch.distributed as dist

from lockstep import Accelerator

if os.environ.get("LOCKSTEP_TEST_OWN_GROUP") == "1":
    dist.init_process_group("gloo")
accelerator = Accelerator()
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
accelerator.backward(model(torch.randn(8, 4)).pow(2).mean())
optimizer.step()
accelerator.end_training()
accelerator.wait_for_everyone()
total = accelerator.reduce(torch.tensor([1.0]), reduction="sum").item()
if accelerator.is_main_process:
    accelerator.save(accelerator.unwrap_model(model).state_dict(), sys.argv[1])
accelerator.print(f"after end_training: reduce={total:.0f}")
