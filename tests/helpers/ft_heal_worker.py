"""One replica group of a fault-tolerant job that trains on a prepared loader, run as its own process by
tests/backends/test_fault_tolerance_heal.py.

    python -m tests.helpers.ft_heal_worker GROUP GROUPS LIGHTHOUSE STEPS OUT SEED [GATE AFTER]

Trains ``nn.Linear(4, 2)`` initialised from SEED (a relaunched group gets another seed: only a real heal
brings it to its peers' weights) with SGD and momentum, a StepLR schedule and gradient clipping, on a
prepared loader of sample ids (:func:`inputs_of` turns ids into inputs), until torchft's step count reaches
STEPS. Writes ``OUT.ready`` once it has joined the lighthouse, right before ``prepare`` (where it joins the quorum), a JSON line per loop
iteration to ``OUT.steps`` (``step``: committed steps before it, ``committed``, ``participants``, ``ids``),
and at the end the weights, its pid and its heal record to ``OUT`` (``torch.save``). With GATE, it waits
after the iteration that starts at step AFTER until the file GATE exists (the test's relaunched group is up).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

LR = 0.5
MOMENTUM = 0.9
GAMMA = 0.8
MAX_NORM = 0.05
"""Small enough that every step clips: the norm must be that of the averaged gradient."""
BATCH = 2
PAUSE = 0.1


def samples(groups: int, steps: int) -> int:
    """Enough samples that no group reaches the end of the epoch within ``steps`` + a few discarded steps."""
    return groups * BATCH * (steps + 4)


def inputs_of(ids: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.randn(4, generator=torch.Generator().manual_seed(int(i))) for i in ids])


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(4, 2)


def loss_of(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return module(inputs_of(ids)).pow(2).mean()


def _wait_for(gate: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not gate.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{gate} did not appear within {timeout} s")
        time.sleep(0.01)


def main(argv: list[str]) -> None:
    from lockstep import Accelerator
    from lockstep.backends.ft import FaultToleranceConfig

    group, groups, lighthouse, steps, out, seed = (
        int(argv[0]),
        int(argv[1]),
        argv[2],
        int(argv[3]),
        argv[4],
        int(argv[5]),
    )
    gate, gate_after = (Path(argv[6]), int(argv[7])) if len(argv) > 7 else (None, -1)
    config = FaultToleranceConfig(
        replica_group=group,
        num_replica_groups=groups,
        lighthouse=lighthouse,
        hostname="127.0.0.1",
        timeout=20,
    )
    accelerator = Accelerator(cpu=True, fault_tolerance=config)
    net = model(seed)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    loader = DataLoader(torch.arange(samples(groups, steps)), batch_size=BATCH)
    # What prepare() imports on first use (about 1.5 s here), so that it joins right after the ready file.
    for module in ("lockstep.data.prepare", "torch._dynamo"):
        importlib.import_module(module)

    Path(f"{out}.ready").touch()
    net, optimizer, loader, scheduler = accelerator.prepare(net, optimizer, loader, scheduler)
    backend = accelerator.backend
    batches = iter(loader)
    while (step := backend.committed_steps) < steps:
        ids = next(batches)
        accelerator.backward(loss_of(net, ids))
        accelerator.clip_grad_norm_(net.parameters(), MAX_NORM)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        line = {
            "step": step,
            "committed": bool(optimizer.optimizer.committed),
            "participants": backend.participants,
            "ids": ids.tolist(),
        }
        with open(f"{out}.steps", "a") as progress:
            progress.write(json.dumps(line) + "\n")
        time.sleep(PAUSE)  # leaves the test time to kill a group between two steps
        if gate is not None and step == gate_after:
            _wait_for(gate)
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    torch.save({"weights": weights, "pid": os.getpid(), "heal": backend.last_heal}, out)
    backend.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(0)  # torchft's servers and gloo threads must not hold the process at exit
