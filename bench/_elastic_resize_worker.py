"""One attempt of bench/elastic_resize.py's job (run by ``lockstep launch``): an FSDP2 MLP with AdamW.

``save``: one step, ``save_state`` (sharded, torch.distributed.checkpoint), then rank 1 writes the time and
kills itself with SIGKILL (the lost machine). ``resume``: ``load_state`` of that checkpoint on however many
processes this launch has, one step; rank 0 writes the times it reached each phase to TIMES (json).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
from torch import nn

from lockstep import Accelerator, FullyShardedDataParallelPlugin


def build(width: int, layers: int) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer]:
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def step(accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, width: int) -> None:
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(accelerator.process_index))
    accelerator.backward(model(x).square().mean())
    optimizer.step()
    optimizer.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", choices=["save", "resume"])
    parser.add_argument("checkpoint")
    parser.add_argument("times")
    parser.add_argument("--width", type=int, default=3584)
    parser.add_argument("--layers", type=int, default=6)
    options = parser.parse_args()
    times = {"started": time.time()}
    accelerator, model, optimizer = build(options.width, options.layers)
    times["prepared"] = time.time()
    if options.mode == "save":
        step(accelerator, model, optimizer, options.width)
        accelerator.save_state(options.checkpoint)
        accelerator.wait_for_everyone()
        if accelerator.process_index == 1:
            with open(options.times, "w") as out:
                json.dump({"killed": time.time()}, out)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)  # the others wait to be stopped, as a job's survivors would
        return
    accelerator.load_state(options.checkpoint)
    times["loaded"] = time.time()
    step(accelerator, model, optimizer, options.width)
    times["first_step"] = time.time()
    if accelerator.is_main_process:
        with open(options.times, "w") as out:
            json.dump({**times, "world": accelerator.num_processes}, out)
    accelerator.end_training()


if __name__ == "__main__":
    main()
