"""Start as a training script does (import torch, build a model and its first optimizer), print and exit:
measures the launcher with the start-up every real worker pays."""

import os

import torch

model = torch.nn.Linear(4, 4)
torch.optim.AdamW(model.parameters(), lr=1e-3)  # the first optimizer imports torch._dynamo
print(f"rank {os.environ.get('RANK')} up", flush=True)
