"""One process of a replica group of several processes (DDP or FSDP2 inside the group) in a fault-tolerant
job, started by ``lockstep launch --fault-tolerance --num-processes N`` in
tests/fault_tolerance/test_fault_tolerance_groups.py.

    lockstep launch ... tests/helpers/ft_group_worker.py STEPS OUTDIR SEED RELAUNCH_SEED

Trains the model of :mod:`tests.helpers.ft_heal_worker` (same loss, optimizer, schedule and clipping) on a
prepared loader of sample ids until torchft's step count reaches STEPS. A process of a relaunched group
(``TORCHELASTIC_RESTART_COUNT`` > 0, the launcher's restart) starts from RELAUNCH_SEED, so only a real heal
brings it to its peers' weights. Each process is named ``g<group>a<attempt>r<rank>`` and writes, in OUTDIR:
a JSON line per loop iteration to ``NAME.steps`` (as the heal worker, plus ``pid``), and at the end
``NAME.pt`` (its pid, its heal record, on rank 0 the whole model's weights, and what ``gather_for_metrics``
returned over an evaluation pass of EVAL_SAMPLES samples in eval mode: the sample ids and the model's
outputs). No group waits for another: the job's start rules make the first quorum hold every group, and a
restarted group heals and rejoins while the others train on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from tests.helpers.ft_heal_worker import (
    BATCH,
    LR,
    MOMENTUM,
    epoch_batches,
    inputs_of,
    model,
    train_step,
)

GAMMA = 0.9995
"""The StepLR factor: over 3,000 steps of 2 processes (the longest run) the rate ends at 5% of its start, so
every step up to the last moves the weights (and can differ from the replay)."""
EVAL_SAMPLES = 11
"""An evaluation set whose last batch (of 2 per process) holds one sample: the group's last round is padded."""


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("steps", type=int)
    parser.add_argument("outdir", type=Path)
    parser.add_argument("seed", type=int)
    parser.add_argument("relaunch_seed", type=int)
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    from lockstep import Accelerator
    from lockstep.backends import LiveRecovery

    args = _arguments(argv)
    accelerator = Accelerator()
    layer = accelerator.capability(LiveRecovery)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    group, rank, processes = (
        layer.config.replica_group,
        accelerator.process_index,
        accelerator.num_processes,
    )
    name = args.outdir / f"g{group}a{attempt}r{rank}"
    net = model(args.seed if attempt == 0 else args.relaunch_seed)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    slots = layer.config.num_replica_groups * processes
    loader = DataLoader(torch.arange(BATCH * epoch_batches(slots, args.steps)), batch_size=BATCH)
    evaluation = DataLoader(torch.arange(EVAL_SAMPLES), batch_size=BATCH)
    net, optimizer, loader, scheduler, evaluation = accelerator.prepare(
        net, optimizer, loader, scheduler, evaluation
    )
    _train(accelerator, net, optimizer, scheduler, loader, name, args.steps)
    weights = {k: v.detach().clone() for k, v in accelerator.get_state_dict(net).items()}
    record = {"pid": os.getpid(), "heal": layer.last_heal, "weights": weights if rank == 0 else None}
    record["evaluated"] = _evaluate(accelerator, net, evaluation)
    torch.save(record, f"{name}.pt")
    accelerator.wait_for_everyone()
    layer.close()


def _evaluate(accelerator: Any, net: Any, evaluation: Any) -> dict[str, Any]:
    """The gathered sample ids and outputs of one evaluation pass, the model in eval mode."""
    net.eval()
    ids, outputs = [], []
    with torch.no_grad():
        for batch in evaluation:
            ids.append(accelerator.gather_for_metrics(batch))
            outputs.append(accelerator.gather_for_metrics(net(inputs_of(batch))))
    net.train()
    return {"ids": torch.cat(ids).tolist(), "outputs": torch.cat(outputs)}


def _train(
    accelerator: Any,
    net: Any,
    optimizer: Any,
    scheduler: Any,
    loader: Any,
    name: Path,
    steps: int,
) -> None:
    from lockstep.backends import LiveRecovery

    layer, batches = accelerator.capability(LiveRecovery), iter(loader)
    while (step := layer.committed_steps) < steps:
        ids = next(batches, None)
        if ids is None:  # the epoch ended: the next one
            batches = iter(loader)
            continue
        line = {**train_step(accelerator, net, optimizer, scheduler, loader, ids, step), "pid": os.getpid()}
        line["time"] = time.time()
        with open(f"{name}.steps", "a") as progress:
            progress.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
