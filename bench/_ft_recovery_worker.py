"""One process of bench/ft_recovery.py, run under ``lockstep launch``.

    _ft_recovery_worker.py live|elastic OUT_DIR --steps N --kill-at K --width W --layers L [--every E]

``live``: one replica group of a fault-tolerant job (the launcher's ``--fault-tolerance`` flags configure the
Accelerator); trains until torchft's committed step count reaches N. ``elastic``: one rank of a plain DDP job
started with ``--max-restarts 1``; saves the state every E steps and resumes from the newest at start. Both
train the same MLP with AdamW on seeded random batches and append a JSON line per step (``t``: wall time at
its end, ``step``: steps done before it, ``committed``, ``attempt``) to ``OUT_DIR/<group or rank>.steps``.
The last group (live) or rank (elastic, first attempt only) writes ``OUT_DIR/killed`` (the wall time) and
SIGKILLs itself after step K, standing for a lost machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn


class Counter:
    """The steps done, saved and restored with the state (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = int(state["value"])


def mlp(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]
    return nn.Sequential(*blocks, nn.Linear(width, 1))


def batch(index: int, step: int, width: int) -> torch.Tensor:
    return torch.randn(16, width, generator=torch.Generator().manual_seed(10_000 * step + index))


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=("live", "elastic"))
    parser.add_argument("out", type=Path)
    for name in ("--steps", "--kill-at", "--width", "--layers"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--every", type=int, default=5, help="elastic: save the state every this many steps")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _arguments(sys.argv[1:] if argv is None else argv)
    from lockstep import Accelerator, ProjectConfiguration

    live = args.mode == "live"
    project = (
        None
        if live
        else ProjectConfiguration(project_dir=str(args.out / "project"), automatic_checkpoint_naming=True)
    )
    accelerator = Accelerator(cpu=True, project_config=project)
    net = mlp(args.width, args.layers)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    net, optimizer = accelerator.prepare(net, optimizer)
    counter = Counter()
    if live:
        me, last = accelerator.backend.config.replica_group, accelerator.backend.config.num_replica_groups - 1
        done = lambda: accelerator.backend.committed_steps  # noqa: E731
    else:
        accelerator.register_for_checkpointing(counter)
        accelerator.resume_from_latest_checkpoint()
        me, last = accelerator.process_index, accelerator.num_processes - 1
        done = lambda: counter.value  # noqa: E731
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = open(args.out / f"{me}.steps", "a")
    while (step := done()) < args.steps:
        loss = net(batch(me, step, args.width)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        committed = bool(optimizer.optimizer.committed) if live else True
        counter.value += 1
        log.write(
            json.dumps({"t": time.time(), "step": step, "committed": committed, "attempt": attempt}) + "\n"
        )
        log.flush()
        if not live and counter.value % args.every == 0:
            accelerator.save_state()
        if me == last and attempt == 0 and done() == args.kill_at:
            (args.out / "killed").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
    log.close()
    accelerator.end_training()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
