"""A short DDP run that ends without any explicit clean-up: the exit hook must tear gloo down safely."""

import torch

from lockstep import Accelerator

accelerator = Accelerator()
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
for _ in range(3):
    accelerator.backward(model(torch.randn(8, 4)).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
accelerator.print("done")
