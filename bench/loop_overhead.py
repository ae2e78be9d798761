"""lockstep's own time per training step, in microseconds: the part of a step ratio that is not noise.

A step-time ratio on a shared 2-core machine moves by several percent from run to run (the DDP MLP step
of ``bench/peers/run`` has given 0.99-1.10), which hides whether lockstep adds anything at all. This
benchmark measures what lockstep adds directly: one process, a model so small that a step is almost all
Python (``nn.Linear(16, 1)``, batch 8), trained by a hand-written loop and by the lockstep loop (prepared
model, optimizer and shuffled loader, ``accelerator.backward``) in alternating blocks of steps (ABBA).
The difference of the two medians is lockstep's cost per step: the loader's position tracking, the
wrappers of the optimizer and of ``backward``. Dividing it by a real step time gives the ratio it can
explain, e.g. for the 8 ms DDP MLP step of the peers benchmark.

    .venv/bin/python bench/loop_overhead.py [--blocks 12 --steps 1000 --real-step-ms 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)


def _loader(steps: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(steps * 8, 16, generator=generator), torch.randn(steps * 8, 1))
    return DataLoader(data, batch_size=8, shuffle=True)


def hand_written_block(steps: int) -> float:
    """Seconds per step of the plain loop."""
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = _loader(steps)
    started = time.perf_counter()
    for inputs, targets in loader:
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return (time.perf_counter() - started) / steps


def lockstep_block(accelerator, steps: int) -> float:
    """Seconds per step of the same loop written for lockstep (prepare is outside the timing)."""
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _loader(steps))
    started = time.perf_counter()
    for inputs, targets in loader:
        loss = nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument(
        "--real-step-ms", type=float, default=8.0, help="a real step, to express the cost as a ratio"
    )
    args = parser.parse_args()
    from lockstep import Accelerator

    accelerator = Accelerator()
    lockstep_block(accelerator, 50)  # warm: lazy imports, first prepare
    hand_written_block(50)
    times: dict[str, list[float]] = {"hand-written": [], "lockstep": []}
    for block in range(args.blocks):
        order = ("hand-written", "lockstep") if block % 2 == 0 else ("lockstep", "hand-written")
        for name in order:
            seconds = (
                hand_written_block(args.steps)
                if name == "hand-written"
                else lockstep_block(accelerator, args.steps)
            )
            times[name].append(seconds)
    plain, ours = (statistics.median(times[name]) * 1e6 for name in ("hand-written", "lockstep"))
    differences = sorted((b - a) * 1e6 for a, b in zip(times["hand-written"], times["lockstep"], strict=True))
    quartiles = statistics.quantiles(differences, n=4)
    print(f"{args.blocks} blocks of {args.steps} steps, ABBA, one process, nn.Linear(16, 1), batch 8:")
    print(f"  hand-written loop  {plain:7.1f} us per step")
    print(f"  lockstep loop      {ours:7.1f} us per step")
    print(
        f"  lockstep's cost    {ours - plain:7.1f} us per step (per-block differences: quartiles "
        f"{quartiles[0]:.1f} to {quartiles[2]:.1f} us)"
    )
    print(
        f"  as a ratio on a {args.real_step_ms:g} ms step: {1 + (ours - plain) / (args.real_step_ms * 1e3):.4f}"
    )


if __name__ == "__main__":
    main()
