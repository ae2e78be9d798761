"""One replica group of a fault-tolerant job that trains on a prepared loader, run as its own process by
tests/fault_tolerance/test_fault_tolerance_heal.py.

    python -m tests.helpers.ft_heal_worker GROUP GROUPS LIGHTHOUSE STEPS OUT SEED [--pause SECONDS]
        [--project DIR]

Trains ``nn.Linear(4, 2)`` initialised from SEED (a relaunched group gets another seed: only a real heal
brings it to its peers' weights) with SGD and momentum, a StepLR schedule and gradient clipping, on a
prepared loader of sample ids (:func:`inputs_of` turns ids into inputs), until torchft's step count reaches
STEPS, over epochs of :func:`epoch_batches` global batches. Writes a JSON line per loop
iteration to ``OUT.steps`` (``step``: committed steps before it, ``committed``, ``participants``, ``ids``, and the loader's draw:
``epoch``, ``consumed`` global batches before the step, this group's ``rank`` among the participants, the
global ``batch`` it read and whether it was ``padded``),
and at the end the weights, its pid and its heal record to ``OUT`` (``torch.save``). It waits ``--pause``
seconds after each step (default 0.1).
With ``--project``, it resumes from the project's newest checkpoint at start and saves one after every step;
a lost lighthouse's error (and the step it stopped at) goes to ``OUT.error``.
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
from torch import nn
from torch.utils.data import DataLoader

LR = 0.5
MOMENTUM = 0.9
GAMMA = 0.995
"""StepLR's factor per scheduler step: the rate still moves the weights after a thousand steps (a heal's
later steps must count in the comparison with the replay), and a scheduler off by one step shows."""
MAX_NORM = 0.05
"""Small enough that every step clips: the norm must be that of the averaged gradient."""
BATCH = 2
PAUSE = 0.1


def epoch_batches(groups: int, steps: int) -> int:
    """Global batches per epoch: about half the run's, so that an epoch ends (and the next begins) mid-run."""
    return groups * steps // 2 + 1


def batch_ids(index: int) -> list[int]:
    """The sample ids of global batch ``index`` of any epoch (the loader reads the data in order)."""
    return list(range(index * BATCH, (index + 1) * BATCH))


def inputs_of(ids: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.randn(4, generator=torch.Generator().manual_seed(int(i))) for i in ids])


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(4, 2)


def targets_of(ids: torch.Tensor) -> torch.Tensor:
    """Each sample's own random target: the weights never settle, so the last steps' batches show in them."""
    return torch.stack([torch.randn(2, generator=torch.Generator().manual_seed(10**6 + int(i))) for i in ids])


def loss_of(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Squared error against :func:`targets_of`. Against a target of zero (this loss until 2026-12-08) the
    weights reached zero within about 400 steps and stayed there, so that runs of a thousand steps ended
    equal to any replay, right or wrong; with these targets a step left out of the last ten moves the final
    weights by about 1e-2, while summing a step's gradients in another order moves them by about 1e-8."""
    return (module(inputs_of(ids)) - targets_of(ids)).pow(2).mean()


def committed_lines(lines: list[dict]) -> dict[int, dict]:
    """The committed steps' lines of one process, by step."""
    return {line["step"]: line for line in lines if line["committed"]}


def step_batches(line: dict, readers: int) -> list[int]:
    """The global batches a committed step used: one per reader (process of a participating group) from the
    step's position on."""
    return [line["consumed"] + rank for rank in range(readers)]


def set_mean_gradients(net: nn.Module, grads: list[list[torch.Tensor]]) -> None:
    """Give ``net``'s parameters the mean of the gradients in ``grads`` (one list per batch, in parameter
    order), summed in that order."""
    for index, parameter in enumerate(net.parameters()):
        total = grads[0][index]
        for other in grads[1:]:
            total = total + other[index]
        parameter.grad = total / len(grads)


def replay(
    lines: list[dict],
    *,
    seed: int,
    epoch: int,
    readers: str = "participants",
    processes: int = 1,
    gamma: float = GAMMA,
) -> dict[str, torch.Tensor]:
    """SGD with momentum over the committed steps of ``lines``, written by hand: each step on the average of
    the gradients of the global batches its readers (``line[readers]`` of them) read, clipped, at the rate
    StepLR(``gamma``) gives that step (a prepared scheduler steps once per process of the group, as
    Accelerate's)."""
    net = model(seed)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    for step, line in sorted(committed_lines(lines).items()):
        grads = []
        for batch in step_batches(line, line[readers]):
            net.zero_grad()
            loss_of(net, torch.tensor(batch_ids(batch % epoch))).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        set_mean_gradients(net, grads)
        torch.nn.utils.clip_grad_norm_(list(net.parameters()), MAX_NORM)
        optimizer.param_groups[0]["lr"] = LR * gamma ** (step * processes)
        optimizer.step()
    return net.state_dict()


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    for name in ("group", "groups"):
        parser.add_argument(name, type=int)
    parser.add_argument("lighthouse")
    parser.add_argument("steps", type=int)
    parser.add_argument("out")
    parser.add_argument("seed", type=int)
    parser.add_argument("--pause", type=float, default=PAUSE, help="seconds to wait after each step")
    parser.add_argument("--timeout", type=float, default=20.0, help="FaultToleranceConfig(timeout=...)")
    parser.add_argument("--project", help="save the state after every step there; resume from it at start")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    from lockstep import Accelerator, ProjectConfiguration
    from lockstep.backends import LiveRecovery
    from lockstep.layers.fault_tolerance import FaultToleranceConfig

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
    loader = DataLoader(torch.arange(BATCH * epoch_batches(args.groups, args.steps)), batch_size=BATCH)
    net, optimizer, loader, scheduler = accelerator.prepare(net, optimizer, loader, scheduler)
    layer = accelerator.capability(LiveRecovery)
    resumed = accelerator.resume_from_latest_checkpoint() if args.project else None
    resumed_at = layer.committed_steps
    try:
        log = _train(accelerator, net, optimizer, scheduler, loader, args)
    except RuntimeError as error:  # the lighthouse was lost: the message and the step, for the test
        Path(f"{out}.error").write_text(f"{layer.committed_steps}\n{error}")
        raise
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    record = {"weights": weights, "pid": os.getpid(), "heal": layer.last_heal, "log": log}
    torch.save({**record, "resumed": resumed, "resumed_at": resumed_at}, out)
    layer.close()


def train_step(
    accelerator: Any,
    net: nn.Module,
    optimizer: Any,
    scheduler: Any,
    loader: Any,
    ids: torch.Tensor,
    step: int,
) -> dict[str, Any]:
    """One step on the batch ``ids`` (clipped, then the schedule); its line: ``step`` (committed steps before
    it), ``committed``, ``participants`` (groups), ``readers`` (processes that read a batch), ``ids`` and the
    loader's draw."""
    from lockstep.backends import LiveRecovery

    draw = loader.steps.last
    accelerator.backward(loss_of(net, ids))
    accelerator.clip_grad_norm_(net.parameters(), MAX_NORM)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return {
        "step": step,
        "committed": not optimizer.step_was_skipped,
        "participants": accelerator.capability(LiveRecovery).participants,
        "ids": ids.tolist(),
        "readers": draw["participants"],  # the processes that read a batch this step
        **{key: draw[key] for key in ("epoch", "consumed", "rank", "batch", "padded")},
    }


def _train(accelerator: Any, net: nn.Module, optimizer: Any, scheduler: Any, loader: Any, args: Any) -> int:
    """The loop until torchft's step count reaches ``args.steps`` (over epochs); returns the iterations run."""
    from lockstep.backends import LiveRecovery

    layer = accelerator.capability(LiveRecovery)
    iterations, batches = 0, iter(loader)
    while (step := layer.committed_steps) < args.steps:
        ids = next(batches, None)
        if ids is None:  # the epoch ended: the next one
            batches = iter(loader)
            continue
        line = train_step(accelerator, net, optimizer, scheduler, loader, ids, step)
        with open(f"{args.out}.steps", "a") as progress:
            progress.write(json.dumps(line) + "\n")
        if args.project and line["committed"]:  # one step, one quorum: the same state on every group
            accelerator.save_state()
        iterations += 1
        time.sleep(args.pause)  # leaves a test time to act between two steps (lose the lighthouse)
    return iterations


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(0)  # torchft's servers and gloo threads must not hold the process at exit
