"""One process of a replica group of two FSDP2 processes in a fault-tolerant job, for
tests/fault_tolerance/test_fault_tolerance_group_resume.py, started by ``lockstep launch --fault-tolerance
--use-fsdp --num-processes 2``.

    ft_group_resume_worker.py save CHECKPOINT OUTDIR   # 3 steps, save_state, 2 more steps
    ft_group_resume_worker.py load CHECKPOINT OUTDIR   # other initial weights, load_state, on to step 5

Trains the model of :mod:`tests.helpers.ft_heal_worker` (its loss, optimizer, schedule and clipping) on a
prepared loader of sample ids. Each process writes ``OUTDIR/<phase><rank>.pt``: torchft's committed steps at
the end, each iteration's line (step, committed, ids read) and the whole model's weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from tests.helpers.ft_heal_worker import BATCH, GAMMA, LR, MOMENTUM, model, train_step

SAVE_AT, STEPS = 3, 5


def main(phase: str, checkpoint: str, outdir: Path) -> None:
    from lockstep import Accelerator
    from lockstep.backends import LiveRecovery

    accelerator = Accelerator()
    net = model(0 if phase == "save" else 5)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    loader = DataLoader(torch.arange(BATCH * 64), batch_size=BATCH)
    net, optimizer, loader, scheduler = accelerator.prepare(net, optimizer, loader, scheduler)
    layer = accelerator.capability(LiveRecovery)
    if phase == "load":
        accelerator.load_state(checkpoint)
    batches, lines = iter(loader), []
    while (step := layer.committed_steps) < STEPS:
        lines.append(train_step(accelerator, net, optimizer, scheduler, loader, next(batches), step))
        if phase == "save" and layer.committed_steps == SAVE_AT:
            accelerator.save_state(checkpoint)
    weights = {key: value.detach().clone() for key, value in accelerator.get_state_dict(net).items()}
    record = {"steps": layer.committed_steps, "lines": lines, "weights": weights}
    torch.save(record, outdir / f"{phase}{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()
    layer.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
