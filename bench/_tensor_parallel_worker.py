"""Worker of tensor_parallel_overhead.py: hand-written ``parallelize_module`` (+ ``fully_shard``) steps against
lockstep ``ParallelismConfig`` steps, and model-state bytes per rank against DDP."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from _residual_mlp import DEPTH, WIDTH, Layer, batches
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lockstep import Accelerator, ParallelismConfig
from lockstep.memory.accounting import account_memory
from lockstep.utils import TorchTensorParallelConfig

torch.set_num_threads(1)
PLAN = {"layers.*.up": "colwise", "layers.*.down": "rowwise"}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Model()


def hand_written(tp: int, dp_shard: int):
    names = ("dp_shard", "tp") if dp_shard > 1 else ("tp",)
    mesh = init_device_mesh("cpu", (dp_shard, tp) if dp_shard > 1 else (tp,), mesh_dim_names=names)
    model = make_model()
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if dp_shard > 1:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x, y) -> None:
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step, model, optimizer


def through_lockstep(accelerator: Accelerator):
    model = make_model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(x, y) -> None:
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()

    return step, model, optimizer


def timed(step, data, steps: int) -> float:
    """Seconds per step of the whole group: the barriers keep one rank's lag from the previous block (or
    from a scheduler stall under load) out of this block's time."""
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        step(*next(data))
    dist.barrier()
    return (time.perf_counter() - started) / steps


def ddp_bytes() -> int:
    model = nn.parallel.DistributedDataParallel(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = next(batches(0))
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    return account_memory(model, optimizer).model_state_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dp-shard", type=int, default=1)
    args = parser.parse_args()
    world = int(__import__("os").environ["WORLD_SIZE"])
    tp = world // args.dp_shard
    accelerator = Accelerator(
        parallelism_config=ParallelismConfig(
            dp_shard_size=args.dp_shard,
            tp_size=tp,
            tp_handler=TorchTensorParallelConfig(parallelize_plan=PLAN),
        )
    )
    dp_rank = dist.get_rank() // tp
    runs = {"torch": hand_written(tp, args.dp_shard), "lockstep": through_lockstep(accelerator)}
    data = {name: batches(dp_rank) for name in runs}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for name, (step, _, _) in runs.items():
        timed(step, data[name], 3)  # warm-up
    for block in range(args.blocks):  # interleaved ABBA
        for name in list(runs) if block % 2 == 0 else list(runs)[::-1]:
            times[name].append(timed(runs[name][0], data[name], args.steps))
    _, model, optimizer = runs["lockstep"]
    x, y = next(data["lockstep"])  # gradients held, as in ddp_bytes (the timed steps end with zero_grad)
    accelerator.backward(nn.functional.cross_entropy(model(x), y))
    held = account_memory(model, optimizer).model_state_bytes
    optimizer.zero_grad()
    ddp = ddp_bytes()
    if dist.get_rank() == 0:
        ratios = [lock / hand for lock, hand in zip(times["lockstep"], times["torch"])]
        print(
            json.dumps(
                {
                    "torch_ms": statistics.median(times["torch"]) * 1e3,
                    "lockstep_ms": statistics.median(times["lockstep"]) * 1e3,
                    "ratio": statistics.median(ratios),
                    "lockstep_bytes": held,
                    "ddp_bytes": ddp,
                    "world": world,
                    "tp": tp,
                    "dp_shard": args.dp_shard,
                    "parameters": sum(p.numel() for p in make_model().parameters()),
                }
            )
        )
    accelerator.end_training()


if __name__ == "__main__":
    main()
