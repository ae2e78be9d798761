"""One replica group of a fault-tolerant job that trains on a prepared loader, run as its own process by
tests/backends/test_fault_tolerance_heal.py.

    python -m tests.helpers.ft_heal_worker GROUP GROUPS LIGHTHOUSE STEPS OUT SEED [--gate PATH --gate-after STEP]
        [--project DIR]

Trains ``nn.Linear(4, 2)`` initialised from SEED (a relaunched group gets another seed: only a real heal
brings it to its peers' weights) with SGD and momentum, a StepLR schedule and gradient clipping, on a
prepared loader of sample ids (:func:`inputs_of` turns ids into inputs), until torchft's step count reaches
STEPS. Writes ``OUT.ready`` once it has joined the lighthouse, right before ``prepare`` (where it joins the quorum), a JSON line per loop
iteration to ``OUT.steps`` (``step``: committed steps before it, ``committed``, ``participants``, ``ids``),
and at the end the weights, its pid and its heal record to ``OUT`` (``torch.save``). With GATE, it waits
after the iteration that starts at step STEP until the file PATH exists (the test's relaunched group is up).
With ``--project``, it resumes from the project's newest checkpoint at start and saves one after every step;
a lost lighthouse's error (and the step it stopped at) goes to ``OUT.error``.
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


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    for name in ("group", "groups"):
        parser.add_argument(name, type=int)
    parser.add_argument("lighthouse")
    parser.add_argument("steps", type=int)
    parser.add_argument("out")
    parser.add_argument("seed", type=int)
    parser.add_argument("--gate", type=Path)
    parser.add_argument("--gate-after", type=int, default=-1)
    parser.add_argument("--timeout", type=float, default=20.0, help="FaultToleranceConfig(timeout=...)")
    parser.add_argument("--project", help="save the state after every step there; resume from it at start")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    from lockstep import Accelerator, ProjectConfiguration
    from lockstep.backends.ft import FaultToleranceConfig

    args = _arguments(argv)
    out = args.out
    config = FaultToleranceConfig(
        replica_group=args.group,
        num_replica_groups=args.groups,
        lighthouse=args.lighthouse,
        hostname="127.0.0.1",
        timeout=args.timeout,
    )
    project = ProjectConfiguration(
        project_dir=args.project, automatic_checkpoint_naming=args.project is not None, total_limit=2
    )
    accelerator = Accelerator(cpu=True, fault_tolerance=config, project_config=project)
    net = model(args.seed)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    loader = DataLoader(torch.arange(samples(args.groups, args.steps)), batch_size=BATCH)
    # What prepare() imports on first use (about 1.5 s here), so that it joins right after the ready file.
    for module in ("lockstep.data.prepare", "torch._dynamo"):
        importlib.import_module(module)

    Path(f"{out}.ready").touch()
    net, optimizer, loader, scheduler = accelerator.prepare(net, optimizer, loader, scheduler)
    backend = accelerator.backend
    resumed = accelerator.resume_from_latest_checkpoint() if args.project else None
    resumed_at = backend.committed_steps
    batches = iter(loader)
    try:
        log = _train(accelerator, net, optimizer, scheduler, batches, args)
    except RuntimeError as error:  # the lighthouse was lost: the message and the step, for the test
        Path(f"{out}.error").write_text(f"{backend.committed_steps}\n{error}")
        raise
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    record = {"weights": weights, "pid": os.getpid(), "heal": backend.last_heal, "log": log}
    torch.save({**record, "resumed": resumed, "resumed_at": resumed_at}, out)
    backend.close()


def _train(accelerator: Any, net: nn.Module, optimizer: Any, scheduler: Any, batches: Any, args: Any) -> int:
    """The loop until torchft's step count reaches ``args.steps``; returns the iterations run."""
    backend, gate = accelerator.backend, args.gate
    iterations = 0
    while (step := backend.committed_steps) < args.steps:
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
        with open(f"{args.out}.steps", "a") as progress:
            progress.write(json.dumps(line) + "\n")
        if args.project and line["committed"]:  # one step, one quorum: the same state on every group
            accelerator.save_state()
        iterations += 1
        time.sleep(PAUSE)  # leaves the test time to kill a group between two steps
        if gate is not None and step == args.gate_after:
            _wait_for(gate)
    return iterations


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(0)  # torchft's servers and gloo threads must not hold the process at exit
