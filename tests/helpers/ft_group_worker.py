"""One process of a replica group of several processes (DDP or FSDP2 inside the group) in a fault-tolerant
job, started by ``lockstep launch --fault-tolerance --num-processes N`` in
tests/backends/test_fault_tolerance_groups.py.

    lockstep launch ... tests/helpers/ft_group_worker.py STEPS OUTDIR SEED RELAUNCH_SEED [--gate-after STEP]

Trains the model of :mod:`tests.helpers.ft_heal_worker` (same loss, optimizer, schedule and clipping) on a
prepared loader of sample ids until torchft's step count reaches STEPS. A process of a relaunched group
(``TORCHELASTIC_RESTART_COUNT`` > 0, the launcher's restart) starts from RELAUNCH_SEED, so only a real heal
brings it to its peers' weights. Each process is named ``g<group>a<attempt>r<rank>`` and writes, in OUTDIR:
``NAME.ready`` right before ``prepare``, a JSON line per loop iteration to ``NAME.steps`` (as the heal worker,
plus ``pid``), and at the end ``NAME.pt`` (its pid, its heal record, on rank 0 the whole model's weights, and
what ``gather_for_metrics`` returned over an evaluation pass of EVAL_SAMPLES samples in eval mode: the sample
ids and the model's outputs). Every group's first attempt waits until all groups are up before ``prepare`` (so that the first
quorum holds them all). With ``--gate-after``, group 0 waits after the iteration that starts at that step until every
process of group 1's second attempt is ready, then steps slowly until group 1 is back in the quorum.
"""

from __future__ import annotations

import argparse
import importlib
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
    GAMMA,
    LR,
    MOMENTUM,
    PAUSE,
    epoch_batches,
    inputs_of,
    model,
    train_step,
)

SLOW_PAUSE = 1.0
EVAL_SAMPLES = 11
"""An evaluation set whose last batch (of 2 per process) holds one sample: the group's last round is padded."""
STARTED = 0.5
"""Seconds after every group's first process is up: its manager's first heartbeats reach the lighthouse (a
quorum request then waits for a group that heartbeats; with min_replicas=1 it would not wait for one that
has not started)."""


def _wait_for(paths: list[Path], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{[str(p) for p in paths]} did not all appear within {timeout} s")
        time.sleep(0.01)


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("steps", type=int)
    parser.add_argument("outdir", type=Path)
    parser.add_argument("seed", type=int)
    parser.add_argument("relaunch_seed", type=int)
    parser.add_argument("--gate-after", type=int, default=-1)
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    from lockstep import Accelerator

    args = _arguments(argv)
    accelerator = Accelerator()
    backend = accelerator.backend
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    group, rank, processes = (
        backend.config.replica_group,
        accelerator.process_index,
        accelerator.num_processes,
    )
    name = args.outdir / f"g{group}a{attempt}r{rank}"
    net = model(args.seed if attempt == 0 else args.relaunch_seed)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    slots = backend.config.num_replica_groups * processes
    loader = DataLoader(torch.arange(BATCH * epoch_batches(slots, args.steps)), batch_size=BATCH)
    evaluation = DataLoader(torch.arange(EVAL_SAMPLES), batch_size=BATCH)
    for module in ("lockstep.data.prepare", "torch._dynamo"):  # so that prepare() joins right after .ready
        importlib.import_module(module)
    Path(f"{name}.ready").touch()
    if attempt == 0:  # every group heartbeats at the lighthouse before any asks for the first quorum
        _wait_for([args.outdir / f"g{g}a0r0.ready" for g in range(backend.config.num_replica_groups)])
        time.sleep(STARTED)
    net, optimizer, loader, scheduler, evaluation = accelerator.prepare(
        net, optimizer, loader, scheduler, evaluation
    )
    gate = [args.outdir / f"g1a1r{r}.ready" for r in range(processes)] if group == 0 else []
    _train(accelerator, net, optimizer, scheduler, loader, name, args.steps, gate, args.gate_after)
    weights = {k: v.detach().clone() for k, v in accelerator.get_state_dict(net).items()}
    record = {"pid": os.getpid(), "heal": backend.last_heal, "weights": weights if rank == 0 else None}
    record["evaluated"] = _evaluate(accelerator, net, evaluation)
    torch.save(record, f"{name}.pt")
    accelerator.wait_for_everyone()
    backend.close()


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
    gate: list[Path],
    gate_after: int,
) -> None:
    backend, batches = accelerator.backend, iter(loader)
    while (step := backend.committed_steps) < steps:
        ids = next(batches, None)
        if ids is None:  # the epoch ended: the next one
            batches = iter(loader)
            continue
        line = {**train_step(accelerator, net, optimizer, scheduler, loader, ids, step), "pid": os.getpid()}
        with open(f"{name}.steps", "a") as progress:
            progress.write(json.dumps(line) + "\n")
        time.sleep(PAUSE)  # leaves the test time to kill a process between two steps
        if gate and step == gate_after:
            _wait_for(gate)
        if gate and step >= gate_after and backend.participants < backend.config.num_replica_groups:
            # Step slowly until the restarted group is in the quorum: a quorum request that finds the last
            # quorum's groups all asking is answered at once, so group 1 joins only if it asks while
            # group 0 waits here (the lighthouse then waits for group 0 too, up to its join timeout).
            time.sleep(SLOW_PAUSE)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
