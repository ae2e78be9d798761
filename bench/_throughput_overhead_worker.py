"""Worker of throughput_overhead.py: one loop, with step timing switched off, on, and on with jsonl logging.

The three variants train the very same prepared model, optimizer and loader (separate copies differ by
a few percent on their own on a busy 2-core machine: memory placement, cache): between blocks of steps
the Accelerator's step timer is swapped for the do-nothing one and back (and taken off its step hooks).
Each block starts a new pass over the loader, because a loader runs the step hooks it has when an iteration
starts.
"""

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
from lockstep.throughput import NullStepTimer, StepTimer, ThroughputKwargs

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


class Loop:
    """A prepared model, optimizer and loader, and the switch between the three variants."""

    def __init__(self, accelerator: Accelerator, model_name: str) -> None:
        build, features, batch = MODELS[model_name]
        torch.manual_seed(0)
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(
            torch.randn(8192, features, generator=generator),
            torch.randint(0, 10, (8192,), generator=generator),
        )
        model = build()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        self.model, self.optimizer, self.loader = accelerator.prepare(
            model, optimizer, DataLoader(data, batch_size=batch, shuffle=True)
        )
        self.accelerator = accelerator
        self.timer = accelerator._step_timer
        self.trackers = accelerator.trackers
        self.epoch = 0

    def switch(self, variant: str) -> None:
        on = variant != "off"
        self.accelerator._step_timer = self.timer if on else NullStepTimer()
        hooks = self.accelerator._step_hooks
        hooks.remove(self.timer)
        if on:
            hooks.add(self.timer)
        self.accelerator.trackers = self.trackers if variant == "on+jsonl" else []

    def timed_steps(self, steps: int) -> tuple[float, float]:
        """Seconds per step: wall clock, and CPU time of this thread (what the accounting itself costs,
        little affected by other programs competing for the cores)."""
        self.loader.set_epoch(self.epoch)
        self.epoch += 1
        batches = iter(self.loader)
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            x, y = next(batches)
            self.accelerator.backward(nn.functional.cross_entropy(self.model(x), y))
            self.optimizer.step()
            self.optimizer.zero_grad()
        return (time.perf_counter() - wall) / steps, (time.thread_time() - cpu) / steps


def summary(times: dict[str, list[float]]) -> dict:
    off, others = times["off"], [name for name in times if name != "off"]
    ratios = {name: sorted(a / b for a, b in zip(times[name], off)) for name in others}
    return {
        "median_ms": {name: statistics.median(t) * 1e3 for name, t in times.items()},
        "ratio": {name: statistics.median(r) for name, r in ratios.items()},
        "ratio_quartiles": {name: (r[len(r) // 4], r[3 * len(r) // 4]) for name, r in ratios.items()},
    }


def measure(accelerator: Accelerator, model_name: str, blocks: int, steps: int) -> dict:
    loop = Loop(accelerator, model_name)
    variants = ["off", "on", "on+jsonl"]
    first = {}
    for variant in variants:  # the first "on" step counts the model's FLOPs
        loop.switch(variant)
        first[variant] = loop.timed_steps(1)[0]
    for variant in variants:
        loop.switch(variant)
        loop.timed_steps(5)  # warm-up
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for block in range(blocks):  # ABC CBA ...: each variant sees the same machine load on average
        for variant in variants if block % 2 == 0 else variants[::-1]:
            loop.switch(variant)
            seconds, cpu_seconds = loop.timed_steps(steps)
            wall[variant].append(seconds)
            cpu[variant].append(cpu_seconds)
    loop.switch("on+jsonl")
    return {
        "first_ms": {name: seconds * 1e3 for name, seconds in first.items()},
        "wall": summary(wall),
        "cpu": summary(cpu),
    }


def accounting_cost_us(
    accelerator: Accelerator, *, logged: bool, every: int = 10, repeats: int = 3000
) -> float:
    """CPU microseconds one step of accounting costs by itself: a StepTimer driven through the hooks of a
    step (a batch handed over, a backward, an optimizer step, the figures at its end) with no training;
    with ``logged``, the figures also go to the Accelerator's jsonl tracker every ``every`` steps."""
    timer = StepTimer(
        ThroughputKwargs(count_flops=False, log_every_n_steps=every),
        device=torch.device("cpu"),
        num_processes=1,
        models=list,
        optimizers=lambda: [None],
        mixed_precision=lambda: "no",
        log=lambda values, step: accelerator.log(values, step=step),
        logging_active=lambda: logged,
    )
    batches = [(torch.zeros(64, 256), torch.zeros(64, dtype=torch.long))] * repeats
    started = time.thread_time()
    for _ in timer.batches(batches):
        with timer.around_backward():
            pass
        with timer.around_optimizer_step(None):
            pass
    return (time.thread_time() - started) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--models", default="mlp,tiny")
    args = parser.parse_args()
    results: dict = {}
    with tempfile.TemporaryDirectory() as logging_dir:
        accelerators = []
        for name in args.models.split(","):  # one Accelerator per model: a step ends when its optimizer steps
            accelerators.append(Accelerator(step_timing=True, log_with="jsonl", project_dir=logging_dir))
            accelerators[-1].init_trackers(f"bench_{name}")
            results[name] = measure(accelerators[-1], name, args.blocks, args.steps)
        results["accounting_cost_us"] = {
            "on": accounting_cost_us(accelerators[0], logged=False),
            "on+jsonl": accounting_cost_us(accelerators[0], logged=True),
            "on+jsonl every step": accounting_cost_us(accelerators[0], logged=True, every=1),
        }
        if accelerators[0].is_main_process:
            print(json.dumps(results))
        for accelerator in accelerators:
            accelerator.end_training()


if __name__ == "__main__":
    main()
