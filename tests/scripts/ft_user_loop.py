"""A fault-tolerant job's training script as a user writes it, for tests/e2e/test_fault_tolerance_one_history.py,
run by ``lockstep launch --fault-tolerance --replica-group all``: a plain ``Accelerator()``, an MLP trained
with SGD on 96 shuffled samples in batches of 4, and the ordinary loop ``for epoch in range(EPOCHS)`` (with
``train_dl.set_epoch(epoch)`` when FT_SET_EPOCH is set).

What the test injects, through the environment: FT_DELAY seconds times the group's number before the script
builds its Accelerator (groups that start apart), FT_EPOCHS (default 300: long enough for a killed
group's restart to find the others still training), and a SIGKILL of group FT_KILL_GROUP's worker after its
5th step in its first life (its launch restarts it: ``--max-restarts 1``). Each process appends a JSON line
per step to ``FT_OUT/g<group>.<pid>.jsonl`` (the step's committed steps before it, whether it committed, and
the loader's draw), and at the end writes its weights to ``FT_OUT/g<group>.pt``.
"""

from __future__ import annotations

import json
import os
import signal
import time

import torch
from torch import nn
from torch.utils.data import DataLoader

from lockstep import Accelerator
from lockstep.backends import LiveRecovery

SAMPLES, BATCH = 96, 4
EPOCHS = int(os.environ.get("FT_EPOCHS", "300"))


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def inputs_of(ids: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.randn(4, generator=torch.Generator().manual_seed(int(i))) for i in ids])


def targets_of(ids: torch.Tensor) -> torch.Tensor:
    """Each sample's own random target, so that the weights keep moving to the last step (against a target of
    zero the last layer reached zero and the run ended where any history would)."""
    return torch.stack([torch.randn(1, generator=torch.Generator().manual_seed(10**6 + int(i))) for i in ids])


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return (model(inputs_of(ids)) - targets_of(ids)).pow(2).mean()


def main() -> None:
    out = os.environ["FT_OUT"]
    group = int(os.environ["LOCKSTEP_FT_GROUP_OF_ALL"])
    first_life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_life:
        time.sleep(float(os.environ.get("FT_DELAY", "0")) * group)
    accelerator = Accelerator()
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_dl = DataLoader(torch.arange(SAMPLES), batch_size=BATCH, shuffle=True)
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
    layer = accelerator.capability(LiveRecovery)
    kill = first_life and group == int(os.environ.get("FT_KILL_GROUP", "-1"))
    steps = 0
    with open(f"{out}/g{group}.{os.getpid()}.jsonl", "a") as log:
        for epoch in range(EPOCHS):
            if os.environ.get("FT_SET_EPOCH"):
                train_dl.set_epoch(epoch)
            for batch in train_dl:
                before = layer.committed_steps
                accelerator.backward(loss_of(model, batch))
                optimizer.step()
                optimizer.zero_grad()
                line = {
                    "group": group,
                    "step": before,
                    "committed": not accelerator.optimizer_step_was_skipped,
                }
                log.write(json.dumps({**line, "loop_epoch": epoch, **train_dl.steps.last}) + "\n")
                log.flush()
                steps += 1
                if kill and steps == 5:
                    os.kill(os.getpid(), signal.SIGKILL)
    weights = {
        key: value.detach().clone() for key, value in accelerator.unwrap_model(model).state_dict().items()
    }
    torch.save(weights, f"{out}/g{group}.pt")
    layer.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
