"""A CPU-fast classification run: the canonical four-line change, on a synthetic two-spirals task.

Run it on one process or many:

    python examples/cpu_fast.py
    torchrun --nproc_per_node 2 examples/cpu_fast.py --epochs 5
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lockstep import Accelerator, DataLoaderConfiguration, set_seed


def two_spirals(count: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (count,), generator=generator)
    radius = torch.rand(count, generator=generator) * 3 + 0.3
    angle = radius * 2.2 + labels * math.pi
    points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    points += 0.08 * torch.randn(count, 2, generator=generator)
    return TensorDataset(points, labels)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per-process batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--mixed-precision", default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--gradient-accumulation-steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    set_seed(args.seed)
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
    )
    train_dl = DataLoader(two_spirals(args.samples, seed=1), batch_size=args.batch_size, shuffle=True)
    eval_dl = DataLoader(two_spirals(512, seed=2), batch_size=args.batch_size)
    model = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    train_dl, eval_dl, model, optimizer = accelerator.prepare(train_dl, eval_dl, model, optimizer)

    for epoch in range(args.epochs):
        train_dl.set_epoch(epoch)
        model.train()
        for points, labels in train_dl:
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(points), labels)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for points, labels in eval_dl:
                predictions, references = accelerator.gather_for_metrics((model(points).argmax(-1), labels))
                correct += (predictions == references).sum().item()
                total += references.numel()
        accelerator.print(
            f"epoch {epoch + 1}/{args.epochs} loss {loss.item():.4f} eval accuracy {correct / total:.3f}"
        )
    accelerator.print(
        json.dumps(
            {"processes": accelerator.num_processes, "eval_accuracy": correct / total, "eval_examples": total}
        )
    )
    accelerator.end_training()


if __name__ == "__main__":
    main()
