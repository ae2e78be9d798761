"""Worker of ddp_overhead.py: alternate blocks of hand-written DDP steps and lockstep steps."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lockstep import Accelerator

torch.set_num_threads(1)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def make_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(8192, 256, generator=generator), torch.randint(0, 10, (8192,), generator=generator)
    )


def timed_steps(model, optimizer, batches, backward, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        x, y = next(batches)
        loss = nn.functional.cross_entropy(model(x), y)
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return (time.perf_counter() - started) / steps


def endless(loader):
    epoch = 0
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        elif isinstance(getattr(loader, "sampler", None), DistributedSampler):
            loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    data = make_data()
    torch_model = nn.parallel.DistributedDataParallel(make_model())
    torch_optimizer = torch.optim.SGD(torch_model.parameters(), lr=0.01)
    torch_batches = endless(DataLoader(data, batch_size=64, sampler=DistributedSampler(data, shuffle=True)))

    accelerator = Accelerator()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, DataLoader(data, batch_size=64, shuffle=True)
    )
    lockstep_batches = endless(loader)

    torch_times, lockstep_times = [], []
    timed_steps(torch_model, torch_optimizer, torch_batches, lambda loss: loss.backward(), 5)  # warm-up
    timed_steps(model, optimizer, lockstep_batches, accelerator.backward, 5)
    for _ in range(args.blocks):
        torch_times.append(
            timed_steps(torch_model, torch_optimizer, torch_batches, lambda loss: loss.backward(), args.steps)
        )
        lockstep_times.append(
            timed_steps(model, optimizer, lockstep_batches, accelerator.backward, args.steps)
        )
    if dist.get_rank() == 0:
        ratios = [lock / hand for lock, hand in zip(lockstep_times, torch_times)]
        print(
            json.dumps(
                {
                    "torch_ms": statistics.median(torch_times) * 1e3,
                    "lockstep_ms": statistics.median(lockstep_times) * 1e3,
                    "ratio": statistics.median(ratios),
                }
            )
        )
    accelerator.end_training()


if __name__ == "__main__":
    main()
