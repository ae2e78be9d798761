"""Trains the small test transformer with whatever the launcher configured (used with an FSDP YAML)."""

import json
import sys

import torch
from tests.helpers.fsdp_models import data_loader, full_params, loss_of, make_transformer

from lockstep import Accelerator

accelerator = Accelerator()
model = make_transformer()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer, train_dl = accelerator.prepare(model, optimizer, data_loader(32, 2))
for batch in train_dl:
    accelerator.backward(loss_of(model, batch))
    optimizer.step()
    optimizer.zero_grad()
layers = [type(m).__name__ for m in model.modules() if type(m).__name__.startswith("FSDP")]
report = {
    "rank": accelerator.process_index,
    "world": accelerator.num_processes,
    "distributed_type": accelerator.distributed_type.value,
    "mixed_precision": accelerator.mixed_precision,
    "sharded_units": len(layers),
    "checksum": float(full_params(model).sum()),
}
accelerator.wait_for_everyone()
if accelerator.is_main_process:
    json.dump(report, open(sys.argv[1], "w"))
accelerator.end_training()
