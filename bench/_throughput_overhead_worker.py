"""Worker of throughput_overhead.py: the same loop with step timing off, on, and on with jsonl logging."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lockstep import Accelerator

torch.set_num_threads(1)

MODELS = {
    # The MLP of ddp_overhead.py (0.4M parameters, batch 64): a step of about 12 ms on 2 CPU processes.
    "mlp": (
        lambda: nn.Sequential(
            nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        ),
        256,
        64,
    ),
    # A near-empty step, so that the difference on - off is the accounting's own cost per step.
    "tiny": (lambda: nn.Linear(16, 10), 16, 8),
}


def make_loop(accelerator: Accelerator, model_name: str):
    build, features, batch = MODELS[model_name]
    torch.manual_seed(0)
    model = build()
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(8192, features, generator=generator), torch.randint(0, 10, (8192,), generator=generator)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, DataLoader(data, batch_size=batch, shuffle=True)
    )

    def endless():
        epoch = 0
        while True:
            loader.set_epoch(epoch)
            yield from loader
            epoch += 1

    return model, optimizer, endless(), accelerator.backward


def timed_steps(loop, steps: int) -> tuple[float, float]:
    """Seconds per step: wall clock, and CPU time of this thread (what the accounting itself costs,
    insensitive to other programs competing for the cores)."""
    model, optimizer, batches, backward = loop
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        x, y = next(batches)
        backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return (time.perf_counter() - wall) / steps, (time.thread_time() - cpu) / steps


def summary(times: dict[str, list[float]]) -> dict:
    off, others = times["off"], [name for name in times if name != "off"]
    return {
        "median_ms": {name: statistics.median(t) * 1e3 for name, t in times.items()},
        "ratio": {name: statistics.median(a / b for a, b in zip(times[name], off)) for name in others},
        "extra_us": {
            name: statistics.median((a - b) * 1e6 for a, b in zip(times[name], off)) for name in others
        },
    }


def measure(accelerators: dict[str, Accelerator], model_name: str, blocks: int, steps: int) -> dict:
    variants = {name: make_loop(accelerator, model_name) for name, accelerator in accelerators.items()}
    first = {name: timed_steps(loop, 1)[0] for name, loop in variants.items()}  # "on" counts FLOPs here
    for loop in variants.values():
        timed_steps(loop, 5)  # warm-up
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for block in range(blocks):  # ABC CBA ...: each variant sees the same machine load on average
        for name in order if block % 2 == 0 else order[::-1]:
            seconds, cpu_seconds = timed_steps(variants[name], steps)
            wall[name].append(seconds)
            cpu[name].append(cpu_seconds)
    return {
        "first_ms": {name: seconds * 1e3 for name, seconds in first.items()},
        "wall": summary(wall),
        "cpu": summary(cpu),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--models", default="mlp,tiny")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as logging_dir:
        logged = Accelerator(step_timing=True, log_with="jsonl", project_dir=logging_dir)
        logged.init_trackers("bench")
        accelerators = {"off": Accelerator(), "on": Accelerator(step_timing=True), "on+jsonl": logged}
        results = {
            name: measure(accelerators, name, args.blocks, args.steps) for name in args.models.split(",")
        }
        if logged.is_main_process:
            print(json.dumps(results))
        logged.end_training()


if __name__ == "__main__":
    main()
