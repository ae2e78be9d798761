"""Worker of run.py (2 processes under torchrun): step time of the four tools' loops, interleaved ABBA,
then the equal-work runs and, for FSDP, the bytes each rank holds.

    torchrun --nproc_per_node 2 bench/peers/_step_worker.py --workload mlp|transformer|fsdp [--tools a,b]

Rank 0 prints one JSON line: seconds per step per block and tool, optimizer steps counted, the final
losses of the equal-work runs (data in order and shuffled), and for FSDP the bytes per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import _tools
import torch
import torch.distributed as dist
from _ddp_overhead_worker import endless
from _ddp_overhead_worker import make_data as mlp_data
from _ddp_overhead_worker import make_model as make_mlp
from _residual_mlp import WIDTH
from _residual_mlp import make_model as make_fsdp_model
from harness import TOOLS, abba_order
from torch import nn
from torch.utils.data import TensorDataset

from lockstep.memory.accounting import account_memory

torch.set_num_threads(1)
VOCAB, SEQ, DIM = 1000, 32, 128
EQUAL_WORK_STEPS = 20


class TinyTransformer(nn.Module):
    """A 2-layer causal-free encoder language model (0.5M parameters), no dropout so runs compare exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.position = nn.Parameter(torch.zeros(SEQ, DIM))
        layer = nn.TransformerEncoderLayer(DIM, 4, 2 * DIM, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens) + self.position))


def make_transformer() -> nn.Module:
    torch.manual_seed(0)
    return TinyTransformer()


def transformer_data() -> TensorDataset:
    tokens = torch.randint(0, VOCAB, (4096, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def fsdp_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(4096, WIDTH, generator=generator), torch.randint(0, 10, (4096,)))


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.flatten(0, -2), y.flatten())


# workload: (model, data, optimizer, batch per process)
WORKLOADS = {
    "mlp": (make_mlp, mlp_data, lambda m: torch.optim.SGD(m.parameters(), lr=0.01), 64),
    "transformer": (
        make_transformer,
        transformer_data,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.01),
        16,
    ),
    "fsdp": (make_fsdp_model, fsdp_data, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4), 32),
}


def timed_steps(loop: _tools.Loop, batches, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        x, y = next(batches)
        loop.backward(loss_of(loop.model, x, y))
        loop.optimizer.step()
        loop.optimizer.zero_grad()
    return (time.perf_counter() - started) / steps


def build(tool: str, workload: str, *, shuffle: bool) -> _tools.Loop:
    make_model, make_data, make_optimizer, batch = WORKLOADS[workload]
    torch.manual_seed(0)  # every tool draws its shuffle from the same generator state
    return _tools.build(
        tool,
        make_model(),
        make_optimizer,
        make_data(),
        batch_size=batch,
        shuffle=shuffle,
        fsdp=workload == "fsdp",
    )


def time_tools(workload: str, blocks: int, steps: int, tools: list[str]) -> dict:
    loops = {tool: build(tool, workload, shuffle=True) for tool in tools}
    batches = {tool: endless(loop.loader) for tool, loop in loops.items()}
    for tool, loop in loops.items():  # warm-up
        timed_steps(loop, batches[tool], 3)
    times: dict[str, list[float]] = {tool: [] for tool in tools}
    for order in abba_order(tools, blocks):
        for tool in order:
            times[tool].append(timed_steps(loops[tool], batches[tool], steps))
    memory = {}
    if workload == "fsdp":
        for tool, loop in loops.items():
            memory[tool] = account_memory(loop.model, loop.optimizer).model_state_bytes
    return {"seconds": times, "steps": {t: loop.steps[0] for t, loop in loops.items()}, "bytes": memory}


def final_loss(tool: str, workload: str, *, shuffle: bool, steps: int = EQUAL_WORK_STEPS) -> dict:
    """Train ``steps`` steps from the same seed, then the loss on a fixed batch of the data."""
    loop = build(tool, workload, shuffle=shuffle)
    batches = endless(loop.loader)
    timed_steps(loop, batches, steps)
    x, y = WORKLOADS[workload][1]()[:256]
    with torch.no_grad():
        loss = loss_of(loop.model, x, y).item()
    return {"steps": loop.steps[0], "final_loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tools", default=",".join(TOOLS), help="a subset, in ABBA order (timing only)")
    parser.add_argument("--equal-work-steps", type=int, default=EQUAL_WORK_STEPS)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    tools = args.tools.split(",")
    result = time_tools(args.workload, args.blocks, args.steps, tools)
    if tools == list(TOOLS):
        result["equal_work"] = {
            order: {
                tool: final_loss(
                    tool, args.workload, shuffle=order == "shuffled", steps=args.equal_work_steps
                )
                for tool in TOOLS
            }
            for order in ("in_order", "shuffled")
        }
    result["parameters"] = sum(p.numel() for p in WORKLOADS[args.workload][0]().parameters())
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo sometimes aborts at interpreter exit (pytorch/pytorch#190489)


if __name__ == "__main__":
    main()
