"""Worker of gpu_check.sh: DDP and FSDP2 steps with NCCL and bf16 autocast, lockstep against hand-written
loops in interleaved ABBA blocks; MFU from lockstep's accounting and by hand; the CUDA timing paths; checkpoint
save and load, and activation memory per policy (_gpu_memory_io.py)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from _gpu_memory_io import activation_figures, checkpoint_figures, print_memory_io
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.flop_counter import FlopCounterMode

from lockstep import Accelerator, FullyShardedDataParallelPlugin

VOCAB, SEQ, DIM, DEPTH, BATCH = 8192, 512, 1024, 8, 8


class Layer(nn.Module):
    """One pre-norm transformer block: the FSDP unit."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.TransformerEncoderLayer(
            DIM, 16, 4 * DIM, dropout=0.0, batch_first=True, norm_first=True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.Sequential(*[Layer() for _ in range(DEPTH)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.embed(tokens)))


def make_model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return Model().to(device)


def batches(device: torch.device, rank: int):
    generator = torch.Generator(device=device).manual_seed(rank)
    while True:
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device=device, generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def hand_written(kind: str, device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], None]:
    model = make_model(device)
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    else:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def through_lockstep(kind: str, device: torch.device) -> tuple:
    plugin = None
    if kind == "fsdp":
        plugin = FullyShardedDataParallelPlugin(
            auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_cls_names_to_wrap=["Layer"]
        )
    accelerator = Accelerator(mixed_precision="bf16", fsdp_plugin=plugin, step_timing=True)
    model = make_model(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        accelerator.backward(loss_of(model, x, y))
        optimizer.step()
        optimizer.zero_grad()

    return step, accelerator


def timed(step, data, steps: int) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step(*next(data))
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps


def compare(kind: str, device: torch.device, blocks: int, steps: int) -> dict:
    rank = dist.get_rank()
    hand = hand_written(kind, device)
    lock, accelerator = through_lockstep(kind, device)
    data = {"torch": batches(device, rank), "lockstep": batches(device, rank)}
    runs = {"torch": hand, "lockstep": lock}
    for name in runs:  # warm-up: allocator, NCCL communicators, cuBLAS plans
        timed(runs[name], data[name], 5)
    times: dict[str, list[float]] = {"torch": [], "lockstep": []}
    for block in range(blocks):
        for name in ("torch", "lockstep") if block % 2 == 0 else ("lockstep", "torch"):
            times[name].append(timed(runs[name], data[name], steps))
    ratios = [lo / ha for lo, ha in zip(times["lockstep"], times["torch"])]
    stats = dict(accelerator.step_stats)
    del hand, lock, accelerator
    torch.cuda.empty_cache()
    return {
        "torch_ms": statistics.median(times["torch"]) * 1e3,
        "lockstep_ms": statistics.median(times["lockstep"]) * 1e3,
        "ratio": statistics.median(ratios),
        "ratio_blocks": ratios,
        "lockstep_step_stats": stats,  # the CUDA-event timing path: time/* keys, flops_per_second, mfu
    }


def flops_per_step(device: torch.device) -> float:
    model = make_model(device)
    x, y = next(batches(device, 0))
    with FlopCounterMode(display=False) as counter, torch.autocast("cuda", dtype=torch.bfloat16):
        loss_of(model, x, y).backward()
    return float(counter.get_total_flops())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    result = {
        "device": torch.cuda.get_device_name(device),
        "world_size": dist.get_world_size(),
        "torch": torch.__version__,
        "model": {"dim": DIM, "depth": DEPTH, "seq": SEQ, "batch_per_rank": BATCH},
    }
    flops = flops_per_step(device)
    for kind in ("ddp", "fsdp"):
        result[kind] = compare(kind, device, args.blocks, args.steps)
        hand_flops_per_second = flops / (result[kind]["torch_ms"] / 1e3)
        result[kind]["hand_flops_per_second"] = hand_flops_per_second
    result["checkpoint"] = checkpoint_figures(
        device, args.out.parent / "gpu-checkpoints", width=2048, layers=12, repeats=3
    )  # 50M parameters: 600 MB with AdamW's state
    result["activations"] = activation_figures(
        device, dim=DIM, depth=DEPTH, vocab=VOCAB, batch=BATCH, seq=SEQ, steps=5
    )
    if dist.get_rank() == 0:
        from lockstep.throughput import device_peak_flops

        peak = device_peak_flops(device, "bf16")
        for kind in ("ddp", "fsdp"):
            figures = result[kind]
            figures["hand_mfu"] = figures["hand_flops_per_second"] / peak if peak else None
            print(
                f"{kind}: hand-written {figures['torch_ms']:.1f} ms, lockstep {figures['lockstep_ms']:.1f} ms, "
                f"ratio {figures['ratio']:.3f} (target {'<= 1.01' if kind == 'ddp' else '<= 1.02'}); "
                f"MFU lockstep {figures['lockstep_step_stats'].get('mfu')}, by hand {figures['hand_mfu']}"
            )
        print_memory_io(result["checkpoint"], result["activations"])
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
