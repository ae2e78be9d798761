"""One replica group of a fault-tolerant job, run as its own process by tests/fault_tolerance/test_fault_tolerance.py.

    python -m tests.helpers.ft_worker GROUP GROUPS LIGHTHOUSE STEPS OUT [PAUSE]

Trains a seeded ``nn.Linear(4, 2)`` with SGD and gradient clipping through ``Accelerator(fault_tolerance=...)`` on batches
that :func:`batch` derives from (group, step), and writes the final weights, its pid and each step's
(committed, participants) to ``OUT`` (``torch.save``); ``OUT.steps`` gets a line per finished step.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

LR = 0.5
MAX_NORM = 0.05
"""Small enough that every step clips: the norm must be that of the averaged gradient."""


def batch(group: int, step: int) -> torch.Tensor:
    """The inputs group ``group`` trains on at step ``step`` (also the reference's)."""
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(1000 * step + group))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


def loss_of(module: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    return module(inputs).pow(2).mean()


def main(group: int, groups: int, lighthouse: str, steps: int, out: str, pause: float = 0.0) -> None:
    from lockstep import Accelerator
    from lockstep.backends import LiveRecovery
    from lockstep.layers.fault_tolerance import FaultToleranceConfig

    config = FaultToleranceConfig(
        replica_group=group,
        num_replica_groups=groups,
        lighthouse=lighthouse,
        hostname="127.0.0.1",
        timeout=20,
    )
    accelerator = Accelerator(cpu=True, fault_tolerance=config)
    net = model()
    net, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    log = []
    for step in range(steps):
        accelerator.backward(loss_of(net, batch(group, step)))
        accelerator.clip_grad_norm_(net.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        log.append((not optimizer.step_was_skipped, accelerator.capability(LiveRecovery).participants))
        with open(f"{out}.steps", "a") as progress:  # the test kills a group once it has stepped enough
            progress.write(f"{step}\n")
        time.sleep(pause)  # leaves the test time to kill a group between two steps
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    torch.save({"weights": weights, "pid": os.getpid(), "log": log}, out)
    accelerator.capability(LiveRecovery).close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    pause = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5], pause)
    sys.stdout.flush()
    os._exit(0)  # torchft's servers and gloo threads must not hold the process at exit
