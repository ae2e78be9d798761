"""Worker of fsdp_overhead.py: hand-written fully_shard steps against lockstep FSDP steps, and memory."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from _residual_mlp import DEPTH, batches, make_model
from torch import nn
from torch.distributed.fsdp import fully_shard

from lockstep import Accelerator, FullyShardedDataParallelPlugin
from lockstep.memory.accounting import account_memory

torch.set_num_threads(1)


def timed_steps(model, optimizer, data, backward, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        x, y = next(data)
        backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return (time.perf_counter() - started) / steps


def hand_written() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_model()
    for layer in list(model)[:DEPTH]:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def through_lockstep(accelerator: Accelerator) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return accelerator.prepare(model, optimizer)


def memory(accelerator: Accelerator) -> dict:
    """Bytes of parameters + gradients + AdamW state per rank after one step: DDP against FSDP."""
    result = {}
    for name, model in (("ddp", nn.parallel.DistributedDataParallel(make_model())), ("fsdp", None)):
        if model is None:
            model, optimizer = through_lockstep(accelerator)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x, y = next(batches(0))
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        account = account_memory(model, optimizer)
        result[name] = account.model_state_bytes
        result["parameters"] = sum(p.numel() for p in make_model().parameters())
        del model, optimizer
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    accelerator = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(
            auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_cls_names_to_wrap=["Layer"]
        )
    )
    rank = dist.get_rank()
    torch_model, torch_optimizer = hand_written()
    model, optimizer = through_lockstep(accelerator)
    torch_data, lockstep_data = batches(rank), batches(rank)
    timed_steps(torch_model, torch_optimizer, torch_data, lambda loss: loss.backward(), 3)  # warm-up
    timed_steps(model, optimizer, lockstep_data, accelerator.backward, 3)
    torch_times, lockstep_times = [], []
    for block in range(args.blocks):  # interleaved ABBA, so both see the same machine load
        order = [
            ("torch", torch_model, torch_optimizer, torch_data, lambda loss: loss.backward()),
            ("lockstep", model, optimizer, lockstep_data, accelerator.backward),
        ]
        for name, m, o, d, b in order if block % 2 == 0 else order[::-1]:
            (torch_times if name == "torch" else lockstep_times).append(timed_steps(m, o, d, b, args.steps))
    measured = memory(accelerator)
    if rank == 0:
        ratios = [lock / hand for lock, hand in zip(lockstep_times, torch_times)]
        print(
            json.dumps(
                {
                    "torch_ms": statistics.median(torch_times) * 1e3,
                    "lockstep_ms": statistics.median(lockstep_times) * 1e3,
                    "ratio": statistics.median(ratios),
                    "world": dist.get_world_size(),
                    **measured,
                }
            )
        )
    accelerator.end_training()


if __name__ == "__main__":
    main()
