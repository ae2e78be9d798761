"""An ordinary training loop for tests/e2e/test_layer_plugin.py, run by ``lockstep launch`` with the
step-veto layer (tests/plugins/step_veto.py) installed: ``Accelerator()`` (the layer from the launch's
flags or config file) or, with ``keyword`` as the second argument, ``Accelerator(step_veto=StepVeto(...))``.
Prints one JSON line per rank: whether each step changed the weights, and ``optimizer_step_was_skipped``."""

from __future__ import annotations

import json
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from lockstep import Accelerator

STEPS = 6


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[2] == "keyword":
        from tests.plugins.step_veto import StepVeto

        accelerator = Accelerator(step_veto=StepVeto(veto_step=2, report=sys.argv[1]))
    else:
        accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = torch.randn(2 * 4 * STEPS, 4)
    loader = DataLoader(TensorDataset(data, data.sum(1, keepdim=True)), batch_size=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    changed, skipped = [], []
    for inputs, targets in loader:
        before = [p.detach().clone() for p in model.parameters()]
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        changed.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
        skipped.append(accelerator.optimizer_step_was_skipped)
    line = {"rank": accelerator.process_index, "changed": changed, "skipped": skipped}
    print("LAYER " + json.dumps(line), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
