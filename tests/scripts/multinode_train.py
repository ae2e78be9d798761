"""Train the parity model; rank 0 prints the final parameters as JSON (used by the multi-machine test)."""

import json

import torch
from tests.helpers.training import flat_params, loader, loss_fn, make_model

from lockstep import Accelerator

accelerator = Accelerator()
model = make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer, train_dl = accelerator.prepare(model, optimizer, loader(48, 4))
for _epoch in range(2):
    for batch in train_dl:
        accelerator.backward(loss_fn(model, batch))
        optimizer.step()
        optimizer.zero_grad()
if accelerator.is_main_process:
    print("PARAMS " + json.dumps(flat_params(accelerator.unwrap_model(model)).tolist()), flush=True)
accelerator.end_training()
