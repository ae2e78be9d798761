"""Worker of expert_parallel.py (CPU, gloo) and gpu_expert_parallel.sh (CUDA, NCCL, bf16 autocast).

Hand-written DDP with every expert on every rank against lockstep with ep=1 (plain DDP through the Accelerator)
and with expert parallelism (``ParallelismConfig(ep_size=N)``), on transformers' own Qwen3-MoE built from its
config, AdamW, in interleaved blocks (the order reversed every other block); then, per layout, the bytes of
parameters, gradients and AdamW state a rank holds (experts apart from the dense part,
``lockstep.layers.expert_parallel.expert_memory``) and, on CUDA, each layout's peak allocated memory measured
alone. Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep import Accelerator, ParallelismConfig
from lockstep.layers.expert_parallel import expert_memory

torch.set_num_threads(1)

Step = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class Sizes:
    """The Qwen3-MoE built from its config, and each rank's batch."""

    hidden: int
    layers: int
    experts: int
    top_k: int
    expert_width: int
    vocab: int
    batch: int
    sequence: int


def build_model(sizes: Sizes, device: torch.device) -> nn.Module:
    """The same weights on every rank and in every layout; router aux loss on, as one trains a MoE."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=sizes.vocab,
        hidden_size=sizes.hidden,
        num_hidden_layers=sizes.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=sizes.hidden // 4,
        num_experts=sizes.experts,
        num_experts_per_tok=sizes.top_k,
        moe_intermediate_size=sizes.expert_width,
        intermediate_size=4 * sizes.hidden,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        max_position_embeddings=max(64, sizes.sequence),
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).to(device)


def batches(sizes: Sizes, device: torch.device, rank: int) -> Iterator[torch.Tensor]:
    """Each rank its own token ids (every layout routes the same tokens from the same rank)."""
    generator = torch.Generator().manual_seed(1000 + rank)
    while True:
        ids = torch.randint(0, sizes.vocab, (sizes.batch, sizes.sequence), generator=generator)
        yield ids.to(device)


def autocast(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


@dataclass
class Layout:
    """One way of training: its step, the model to account (unwrapped) and its optimizer."""

    step: Step
    model: nn.Module
    optimizer: torch.optim.Optimizer
    backward: Callable[[torch.Tensor], None]
    accelerator: Accelerator | None = None


def make_optimizer(model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")


def hand_written(sizes: Sizes, device: torch.device, bf16: bool) -> Layout:
    """What a user has today: DDP, every expert on every rank."""
    model = build_model(sizes, device)
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    optimizer = make_optimizer(ddp, device)

    def step(ids: torch.Tensor) -> None:
        with autocast(device, bf16):
            loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def backward(ids: torch.Tensor) -> None:
        with autocast(device, bf16):
            loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()

    return Layout(step, model, optimizer, backward)


def through_lockstep(sizes: Sizes, device: torch.device, bf16: bool, ep: int) -> Layout:
    """lockstep: ``ep == 1`` plain DDP through the Accelerator, else the experts sharded over ep ranks."""
    accelerator = Accelerator(
        mixed_precision="bf16" if bf16 else "no",
        parallelism_config=ParallelismConfig(ep_size=ep) if ep > 1 else None,
    )
    model = build_model(sizes, device)
    prepared, optimizer = accelerator.prepare(model, make_optimizer(model, device))

    def step(ids: torch.Tensor) -> None:
        accelerator.backward(prepared(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()

    def backward(ids: torch.Tensor) -> None:
        accelerator.backward(prepared(input_ids=ids, labels=ids).loss)

    return Layout(step, accelerator.unwrap_model(prepared), optimizer, backward, accelerator)


def build(name: str, sizes: Sizes, device: torch.device, bf16: bool) -> Layout:
    if name == "torch":
        return hand_written(sizes, device, bf16)
    return through_lockstep(sizes, device, bf16, int(name.removeprefix("ep=")))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Step, data: Iterator[torch.Tensor], steps: int, device: torch.device) -> float:
    """Seconds per step of the whole group: the barriers keep one rank's lag (or a scheduler stall under
    load) out of the next block's time."""
    synchronize(device)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        step(next(data))
    synchronize(device)
    dist.barrier()
    return (time.perf_counter() - started) / steps


def held_bytes(layout: Layout, ids: torch.Tensor) -> dict[str, Any]:
    """Parameters + gradients + AdamW state this rank holds, gradients held (the timed steps end with
    ``zero_grad``, which frees them)."""
    layout.backward(ids)
    held = expert_memory(layout.model, layout.optimizer)
    layout.optimizer.zero_grad()
    return {
        "experts": held.experts.model_state_bytes,
        "dense": held.dense.model_state_bytes,
        "experts_per_block": sorted(set(held.experts_per_block.values())),
    }


def peak_alone(name: str, sizes: Sizes, device: torch.device, bf16: bool, steps: int) -> int | None:
    """The allocator's peak over building this layout and ``steps`` steps of it, above what was allocated
    before (anything an earlier layout left is not counted); CUDA only, None on CPU."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    layout = build(name, sizes, device, bf16)
    data = batches(sizes, device, dist.get_rank())
    timed(layout.step, data, steps, device)
    peak = torch.cuda.max_memory_allocated(device) - before
    if layout.accelerator is not None:
        layout.accelerator.free_memory()
    del layout
    return int(peak)


def compare(names: list[str], sizes: Sizes, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    rank = dist.get_rank()
    layouts = {name: build(name, sizes, device, args.bf16) for name in names}
    data = {name: batches(sizes, device, rank) for name in names}
    for name in names:  # warm-up: allocator, communicators, the routing's first all-to-all
        timed(layouts[name].step, data[name], args.warmup, device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for block in range(args.blocks):  # interleaved ABBA (ABC CBA ...)
        for name in names if block % 2 == 0 else names[::-1]:
            times[name].append(timed(layouts[name].step, data[name], args.steps, device))
    ids = next(batches(sizes, device, rank))
    figures = {name: {"bytes": held_bytes(layouts[name], ids)} for name in names}
    for name in names:
        figures[name]["ms"] = statistics.median(times[name]) * 1e3
        if name != "torch":
            ratios = sorted(mine / hand for mine, hand in zip(times[name], times["torch"]))
            figures[name]["ratio"] = statistics.median(ratios)
            figures[name]["ratio_quartiles"] = (
                statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
            )
    for layout in layouts.values():
        if layout.accelerator is not None:
            layout.accelerator.free_memory()
    del layouts
    gc.collect()
    for name in names:
        figures[name]["peak_bytes"] = peak_alone(name, sizes, device, args.bf16, args.warmup)
    return figures


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--sequence", type=int, default=64)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--bf16", action="store_true", help="bf16 autocast (lockstep: mixed_precision='bf16')"
    )
    parser.add_argument("--out", default=None, help="also write the JSON here (rank 0)")
    return parser.parse_args()


def main() -> None:
    args = parse()
    sizes = Sizes(
        args.hidden,
        args.layers,
        args.experts,
        args.top_k,
        args.expert_width,
        args.vocab,
        args.batch,
        args.sequence,
    )
    world = int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    eps = [ep for ep in (2, 4, 8) if ep <= world and world % ep == 0 and sizes.experts % ep == 0]
    names = ["torch", "ep=1", *(f"ep={ep}" for ep in eps)]
    figures = compare(names, sizes, device, args)
    if dist.get_rank() == 0:
        parameters = sum(p.numel() for p in build_model(sizes, torch.device("cpu")).parameters())
        result = {
            "world": world,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "bf16": args.bf16,
            "sizes": sizes.__dict__,
            "parameters": parameters,
            "layouts": figures,
        }
        line = json.dumps(result)
        if args.out:
            with open(args.out, "w") as file:
                file.write(json.dumps(result, indent=1) + "\n")
        print(line)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
